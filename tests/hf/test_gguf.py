"""`gptkit export format=gguf` (gptkit/hf/gguf_file.py): the file read back with gguf-py's reader (the
architecture, the hyperparameters, llama.cpp's tensor names and layouts, the tokenizer, the chat template),
and the refusals in one line. llama.cpp itself loading the files and decoding as `gptkit sample`: .ci/gguf."""

import json

import numpy as np
import pytest
import torch
from conftest import make_run, metaspace_tokenizer, run_main, shakespeare

gguf = pytest.importorskip("gguf")

from gptkit import chat_templates as templates  # noqa: E402
from gptkit.errors import GptkitError  # noqa: E402
from gptkit.model import GPT, ModelConfig  # noqa: E402
from gptkit.runs import write_run_folder  # noqa: E402
from gptkit.tokenizer import build_tokenizer, byte_tokenizer, bytes_to_unicode  # noqa: E402


def read(path):
    """(metadata {key: value}, tensors {name: (type name, shape, array)}) of a GGUF file."""
    r = gguf.GGUFReader(str(path))
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            meta[k] = [f.contents(i) for i in range(len(f.data))] if len(f.data) < 5000 else None
        else:
            meta[k] = f.contents()
    tensors = {
        t.name: (t.tensor_type.name, tuple(int(x) for x in reversed(t.shape)), t.data) for t in r.tensors
    }
    return meta, tensors


def exported(capsys, run, out, *args):
    code, stdout, err = run_main(capsys, "export", f"run={run}", f"out={out}", "format=gguf", *args)
    assert code == 0, err
    return stdout


def test_llama_char_run_as_gguf_f32_and_q8_0(tmp_path, capsys):
    run, model, tok = make_run(tmp_path)
    cfg = model.cfg
    said = exported(capsys, run, tmp_path / "f32")
    assert "llama.cpp's llama" in said and "character vocabulary" in said
    assert sorted(p.name for p in (tmp_path / "f32").iterdir()) == ["Modelfile", "model.gguf"]
    assert (tmp_path / "f32" / "Modelfile").read_text().startswith("FROM ./model.gguf\n")
    meta, tensors = read(tmp_path / "f32" / "model.gguf")
    assert meta["general.architecture"] == "llama"
    assert (
        meta["llama.block_count"] == cfg.n_layers and meta["llama.attention.head_count_kv"] == cfg.n_kv_heads
    )
    assert meta["llama.context_length"] == cfg.max_seq_len and meta["llama.rope.freq_base"] == cfg.rope_theta
    # the char vocabulary as SentencePiece pieces of one character, a space spelled U+2581, no prefix space
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is False
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = tok.get_vocab()
    assert len(tokens) == cfg.vocab_size and tokens[vocab[" "]] == "\u2581" and tokens[vocab["e"]] == "e"
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.ggml.eos_token_id"] == vocab["<|endoftext|>"]
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert np.array_equal(tensors["token_embd.weight"][2], state["tok_emb.weight"])
    assert tensors["blk.1.ffn_down.weight"][1] == tuple(state["blocks.1.mlp.down_proj.weight"].shape)
    # llama.cpp's llama rotates interleaved pairs: each head's row 2j is transformers' row j, 2j+1 is
    # row j + head_dim/2 (the q and k rows of the fused qkv_proj)
    hd, q_rows = cfg.head_dim, cfg.n_heads * cfg.head_dim
    qkv = state["blocks.0.attn.qkv_proj.weight"]
    for name, theirs, heads in (
        ("blk.0.attn_q.weight", qkv[:q_rows], cfg.n_heads),
        ("blk.0.attn_k.weight", qkv[q_rows : q_rows + cfg.n_kv_heads * hd], cfg.n_kv_heads),
    ):
        got = tensors[name][2].reshape(heads, hd, -1)
        want = theirs.reshape(heads, hd, -1)
        assert np.array_equal(got[:, 0::2], want[:, : hd // 2]) and np.array_equal(
            got[:, 1::2], want[:, hd // 2 :]
        )
    assert np.array_equal(tensors["blk.0.attn_v.weight"][2], qkv[q_rows + cfg.n_kv_heads * hd :])

    said = exported(capsys, run, tmp_path / "q8", "dtype=q8_0")
    meta, q8 = read(tmp_path / "q8" / "model.gguf")
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert q8["blk.0.ffn_up.weight"][0] == "Q8_0" and q8["blk.0.attn_norm.weight"][0] == "F32"
    back = gguf.quants.dequantize(q8["blk.0.ffn_up.weight"][2], gguf.GGMLQuantizationType.Q8_0)
    w = state["blocks.0.mlp.up_proj.weight"]
    # one scale per 32 values: within half a step of 1/127 of each block's largest
    assert np.abs(back - w).max() <= np.abs(w).max() / 127 * 0.51 + 1e-6


def test_gpt2_bpe_run_as_gguf_f16(tmp_path, capsys):
    # a byte-level BPE trained here; the model's rows past the tokenizer's (320 > its 300)
    tok_cfg = {"kind": "bpe", "vocab_size": 300, "min_frequency": 2, "special_tokens": ["<|endoftext|>"]}
    tok_cfg["eos_token"] = "<|endoftext|>"
    bpe = build_tokenizer(tok_cfg, texts=lambda: [shakespeare(20_000)], progress=False)
    # a chat model: chatml's template, its end of turn <|im_end|>
    template = templates.resolve_template("chatml", None)
    templates.add_special_tokens(bpe, template)
    torch.manual_seed(0)
    model = GPT(
        ModelConfig(vocab_size=320, max_seq_len=64, n_layers=2, n_heads=4, d_model=32, position="learned")
    )
    run = write_run_folder(tmp_path / "run", {"tokenizer": tok_cfg}, model, bpe)
    (run / templates.CHAT_FILE).write_text(template.to_json())
    said = exported(capsys, run, tmp_path / "f16", "dtype=fp16")
    assert "llama.cpp's gpt2" in said and "gpt-2 pre-tokenizer" in said
    assert "chat template chatml" in said and "end of turn <|im_end|>, <|endoftext|>" in said
    meta, tensors = read(tmp_path / "f16" / "model.gguf")
    end = bpe.token_to_id("<|im_end|>")
    assert meta["tokenizer.chat_template"] == template.text and meta["tokenizer.ggml.eot_token_id"] == end
    stops = (tmp_path / "f16" / "Modelfile").read_text().splitlines()[2:]
    assert stops == ['PARAMETER stop "<|im_end|>"', 'PARAMETER stop "<|endoftext|>"']
    assert meta["general.architecture"] == "gpt2" and meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    d = json.loads(bpe.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]]
    assert meta["tokenizer.ggml.merges"] == merges and len(merges) > 0
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    eos = bpe.token_to_id("<|endoftext|>")
    assert tokens[eos] == "<|endoftext|>" and types[eos] == 3 and types[bpe.token_to_id("a")] == 1
    # the rows past the tokenizer's: unused
    assert all(types[i] == 5 for i in range(bpe.get_vocab_size(), model.cfg.vocab_size))
    assert tokens[bpe.token_to_id(bytes_to_unicode()[ord(" ")])] == "\u0120"
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    # GPT-2's fused qkv as llama.cpp reads it: [out, in] (not Conv1D's [in, out]), f16; its biases f32
    qkv = tensors["blk.0.attn_qkv.weight"]
    assert qkv[0] == "F16" and qkv[1] == tuple(state["blocks.0.attn.qkv_proj.weight"].shape)
    assert np.allclose(
        qkv[2].astype(np.float32), state["blocks.0.attn.qkv_proj.weight"], atol=1e-2, rtol=1e-3
    )
    assert tensors["blk.0.attn_qkv.bias"][0] == "F32"
    assert np.array_equal(
        tensors["position_embd.weight"][2].astype(np.float32).shape, state["pos_emb.weight"].shape
    )
    assert "output.weight" not in tensors  # tied: llama.cpp reads token_embd


def refused(capsys, *args, needles=()):
    """`gptkit export ...` in process: exit 2 and one `error:` line holding the needles."""
    code, out, err = run_main(capsys, "export", *args)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert all(n in err for n in needles), err


LLAMA31 = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_seq_len": 32,
}


def test_llama3_rope_scaling_is_written_as_llama_cpps_rope_freqs(tmp_path, capsys):
    """Llama 3.1's scaling: llama.cpp divides each RoPE frequency by rope_freqs[i]; the divisors are those of
    gptkit's own scaled frequencies (1 for the short wavelengths, factor for the long ones, the band between
    smooth); another family's architecture, or another type, is refused in one line."""
    from gptkit.model.rope_scaling import llama3

    run, model, _ = make_run(tmp_path, rope_scaling=LLAMA31)
    cfg = model.cfg
    exported(capsys, run, tmp_path / "out")
    _, tensors = read(tmp_path / "out" / "model.gguf")
    kind, shape, factors = tensors["rope_freqs.weight"]
    assert kind == "F32" and shape == (cfg.head_dim // 2,)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    scaled, _ = llama3(inv, LLAMA31, cfg.head_dim, cfg.rope_theta)
    assert np.allclose(factors, (inv / scaled).numpy(), rtol=1e-6)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[1:-1].max() <= 8.0
    (tmp_path / "qwen3").mkdir()
    qwen3, _, _ = make_run(tmp_path / "qwen3", qk_norm="head", rope_scaling=LLAMA31)
    refused(capsys, f"run={qwen3}", f"out={tmp_path / 'q'}", "format=gguf", needles=("llama3", "qwen3"))
    (tmp_path / "yarn").mkdir()
    yarn = {"type": "yarn", "factor": 4.0, "original_max_seq_len": 32}
    llama_yarn, _, _ = make_run(tmp_path / "yarn", rope_scaling=yarn)
    refused(
        capsys, f"run={llama_yarn}", f"out={tmp_path / 'y'}", "format=gguf", needles=("yarn", "llama3 is")
    )


def test_gguf_refusals_are_one_line(tmp_path, capsys):
    run, _, _ = make_run(tmp_path)
    out = tmp_path / "out"
    common = (f"run={run}", f"out={out}")
    refused(capsys, *common, "format=gguf", "dtype=q4_k", needles=("Q4_K", "llama-quantize"))
    refused(capsys, *common, "format=gguf", "dtype=int4", needles=("q8_0",))
    refused(capsys, *common, "format=onnx", needles=("format='onnx'", "gguf"))
    # Mistral's window shorter than the context: llama.cpp's llama attends to all of it
    (tmp_path / "mistral").mkdir()
    mistral, _, _ = make_run(tmp_path / "mistral", sliding_window=16)
    refused(capsys, f"run={mistral}", f"out={out}", "format=gguf", needles=("sliding_window=16", "llama"))
    assert not out.exists()


def test_gguf_vocab_refuses_what_llama_cpp_cannot_reproduce(tmp_path):
    from gptkit.hf.gguf_file import gguf_vocab
    from gptkit.tokenizer import char_tokenizer, load_tokenizer_file

    with pytest.raises(GptkitError, match="Metaspace.*llama.cpp"):
        gguf_vocab(load_tokenizer_file(metaspace_tokenizer(tmp_path / "m.json")), 300)
    with pytest.raises(GptkitError, match="maps unknown characters to '<unk>'"):
        gguf_vocab(char_tokenizer("ab c", [], "<unk>"), 10)
    with pytest.raises(GptkitError, match="U\\+2581"):
        gguf_vocab(char_tokenizer("a\u2581 ", []), 10)
    # byte-level without merges: llama.cpp's loader needs tokenizer.ggml.merges
    with pytest.raises(GptkitError, match="without merges"):
        gguf_vocab(byte_tokenizer(["<|endoftext|>"]), 260)
