"""`gptkit eval`: every window of the split, each target scored once, the numbers a direct loop gives."""

import json
import math

import numpy as np
import torch
import torch.nn.functional as F
from conftest import make_run, run_main, shakespeare

from gptkit.data import prepare


def direct_nll(model, tokens: np.ndarray, T: int) -> tuple[float, int]:
    """Sum of cross-entropy over non-overlapping windows, one window at a time."""
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(tokens) - 1, T):
            x = torch.tensor(tokens[s : s + T][None].astype(np.int64))  # [1, <=T]
            y = torch.tensor(tokens[s + 1 : s + T + 1][None].astype(np.int64))  # [1, <=T]
            x = x[:, : y.shape[1]]
            nll += F.cross_entropy(model(x).logits[0], y[0], reduction="sum").item()
            n += y.shape[1]
    return nll, n


def test_own_val_split_matches_a_direct_loop(tmp_path, capsys):
    d, model, tok = make_run(tmp_path, max_seq_len=32)
    code, out, err = run_main(capsys, "eval", f"run={d}", "batch_size=5", "progress=false", "--json")
    assert code == 0, err
    res = json.loads(out)
    val = prepare(
        {"kind": "files", "paths": [str(tmp_path / "corpus.txt")], "val_fraction": 0.1},
        {"kind": "char", "special_tokens": [], "eos_token": "<|endoftext|>", "unk_token": None},
        progress=False,
    ).val_tokens()
    nll, n = direct_nll(model, np.asarray(val), 32)
    # every target once, none sampled away
    assert res["tokens_scored"] == n == len(val) - 1
    assert res["windows"] == math.ceil((len(val) - 1) / 32)
    assert math.isclose(res["loss"], nll / n, rel_tol=1e-5)
    assert math.isclose(res["perplexity"], math.exp(nll / n), rel_tol=1e-5)
    # the scored targets (the EOS decodes to nothing)
    text = tok.decode(np.asarray(val[1:]).tolist())
    assert res["chars"] == len(text) and res["bytes"] == len(text.encode())
    assert math.isclose(res["bits_per_char"], nll / math.log(2) / len(text), rel_tol=1e-5)

    # a smaller stride: still every target once, but each sees more context, so the loss changes
    code, out, err = run_main(capsys, "eval", f"run={d}", "stride=8", "progress=false", "--json")
    strided = json.loads(out)
    assert code == 0 and strided["tokens_scored"] == len(val) - 1 and strided["windows"] > res["windows"]
    assert strided["loss"] != res["loss"]


def test_held_out_file_and_bad_values(tmp_path, capsys):
    d, model, tok = make_run(tmp_path, max_seq_len=32)
    known = set(tok.get_vocab())
    held = "".join(c for c in shakespeare(3_000, start=30_000) if c in known)
    (tmp_path / "held.txt").write_text(held)
    code, out, err = run_main(
        capsys, "eval", f"run={d}", "data=files", f"data.paths=[{tmp_path / 'held.txt'}]", "format=json"
    )
    assert code == 0, err
    res = json.loads(out)
    # the whole file, then EOS
    ids = np.array(tok.encode(held).ids + [tok.token_to_id("<|endoftext|>")])
    nll, n = direct_nll(model, ids, 32)
    assert res["tokens_scored"] == n == len(held)
    assert math.isclose(res["loss"], nll / n, rel_tol=1e-5)
    assert math.isclose(res["bits_per_byte"], nll / math.log(2) / (len(held) - 1), rel_tol=1e-5)

    code, _, err = run_main(capsys, "eval", f"run={d}", "seq_len=64")
    assert code == 2 and err.count("\n") == 1 and "seq_len=64 must be in [1, model.max_seq_len=32]" in err
    code, _, err = run_main(capsys, "eval", f"run={d}", "pack=docs")
    assert code == 2 and err.count("\n") == 1 and "pack='docs' must be stream or documents" in err


def test_packed_documents_are_evaluated_as_they_were_trained():
    """With eos_id (a data.pack=documents run), each window attends only inside its documents and RoPE
    positions restart at each one: the loss of a direct loop over the same windows with doc_ids, and not the
    stream loss."""
    from gptkit.data.windows import doc_ids
    from gptkit.evaluation import evaluate
    from gptkit.model import GPT, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=20,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_model=16,
        d_ff=32,
        max_seq_len=16,
        position="rope",
        mlp="swiglu",
        norm="rmsnorm",
        position_reset=True,
    )
    model = GPT(cfg).eval()
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 20, size=3 * 16 + 1)
    # EOS = 0: documents of 1..12 tokens, some across window edges
    tokens[[3, 9, 20, 21, 40]] = 0
    nll = 0.0
    with torch.no_grad():
        for s in (0, 16, 32):
            x = torch.tensor(tokens[s : s + 16][None].astype(np.int64))  # [1, 16]
            y = torch.tensor(tokens[s + 1 : s + 17][None].astype(np.int64))  # [1, 16]
            nll += F.cross_entropy(model(x, doc_ids=doc_ids(x, 0)).logits[0], y[0], reduction="sum").item()
    packed = evaluate(model, tokens, 16, 16, batch_size=2, eos_id=0)
    stream = evaluate(model, tokens, 16, 16, batch_size=2)
    assert packed["documents"] and not stream["documents"]
    assert packed["tokens_scored"] == 48 and math.isclose(packed["nll_sum"], nll, rel_tol=1e-5)
    # the masking changes the numbers: the test can tell
    assert abs(stream["nll_sum"] - nll) > 1e-3
