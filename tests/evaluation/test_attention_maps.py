"""Attention maps: the eager probabilities as a layers x heads PNG grid written into the run folder."""

import io
import json

import pytest
import torch
from conftest import make_run, run_main

from gptkit.evaluation.attention_maps import attention_probs, render_grid, token_labels


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("attn"), max_seq_len=32)


def test_probabilities_are_causal_rows_that_sum_to_one(run):
    _, model, tok = run
    ids = tok.encode("First Citizen:\nBefore we").ids
    probs = attention_probs(model, ids)
    # per layer [n_heads, T, T]
    assert len(probs) == 2 and tuple(probs[0].shape) == (4, len(ids), len(ids))
    for p in probs:
        torch.testing.assert_close(p.sum(-1), torch.ones(4, len(ids)))
        # no query looks at a later key
        assert p.triu(1).abs().max() == 0
    assert token_labels(tok, ids)[5:9] == ["␣", "C", "i", "t"] and token_labels(tok, ids)[14] == "⏎"


def test_png_grid_has_one_cell_per_layer_and_head(run):
    from PIL import Image

    _, model, tok = run
    ids = tok.encode("To be, or not").ids
    png = render_grid(attention_probs(model, ids), token_labels(tok, ids), "test")
    img = Image.open(io.BytesIO(png))
    # 4 heads wide, 2 layers high
    assert img.format == "PNG" and img.width > img.height
    one_layer = render_grid(attention_probs(model, ids)[:1], token_labels(tok, ids), "test")
    assert Image.open(io.BytesIO(one_layer)).height < img.height


def test_attention_verb_writes_into_the_run_folder(run, capsys):
    d, _, _ = run
    code, out, err = run_main(capsys, "attention", f"run={d}", "text=ROMEO: O, she doth", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["path"] == str(d / "attention" / "attention-ROMEO-O-she-doth.png")
    assert (d / "attention" / "attention-ROMEO-O-she-doth.png").stat().st_size > 10_000
    assert res["layers"] == 2 and res["heads"] == 4 and len(res["mean_entropy_bits"]) == 2

    code, _, err = run_main(capsys, "attention", f"run={d}", "text=" + "a" * 40)
    assert code == 2 and "40 tokens, more than model.max_seq_len=32" in err and err.count("\n") == 1


def test_linear_layers_have_no_row_and_a_model_of_them_alone_is_one_line():
    """A hybrid (Gated DeltaNet layers, then a full one): the full layer's row alone, its layer number kept;
    every layer linear: a GptkitError, not a traceback."""
    from PIL import Image

    from gptkit.errors import GptkitError
    from gptkit.model import GPT, ModelConfig

    gdn = {"n_key_heads": 2, "n_value_heads": 4, "key_head_dim": 8, "value_head_dim": 8}
    cfg = dict(vocab_size=61, max_seq_len=16, n_layers=3, n_heads=4, d_model=32, gdn=gdn)
    model = GPT(ModelConfig(**cfg, layer_types=["linear", "linear", "global"])).eval()
    probs = attention_probs(model, [3, 1, 4, 1, 5])
    assert probs[:2] == [None, None] and tuple(probs[2].shape) == (4, 5, 5)
    img = Image.open(io.BytesIO(render_grid(probs, None, "hybrid")))
    # one row of 4 heads
    assert img.width > 2 * img.height
    alone = GPT(ModelConfig(**cfg, attention_kind="gdn")).eval()
    with pytest.raises(GptkitError, match="no softmax attention layer"):
        attention_probs(alone, [3, 1, 4])
