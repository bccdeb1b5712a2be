"""GLM-4.5 (transformers' Glm4MoeForCausalLM, gptkit/hf/glm4_moe.py): import with transformers' fp32 logits
(<= 1e-5; every weight and the correction bias perturbed, 2 expert groups, a dense first layer, a shared
expert, q/k/v biases, partial RoPE, QK-norm on and off), greedy tokens of `generate`, export back to the same
files bit for bit, the MTP layer kept or dropped with its note, the presets' counts equal transformers' on the
meta device. Tiny random models built from their configs (no hub)."""

import json

import pytest
import torch
import yaml
from conftest import hf_common, hf_export_same_files, hf_import, hf_perturbed, one_line_error, run_cli
from safetensors.torch import load_file, save_file

from gptkit import accounting as acc
from gptkit import hf
from gptkit.conf_tree import conf_dir
from gptkit.errors import GptkitError
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig

transformers = pytest.importorskip("transformers")

V, T = 64, 48
# room to generate 64 tokens past an 8-token prompt
POSITIONS = 80


def hf_model(qk_norm: bool, **change):
    """A tiny Glm4MoeForCausalLM: 3 layers (the first dense), 4 experts in 2 groups (1 kept), top-2, one
    shared expert, routed scale 2.5, q/k/v biases, RoPE over half of each 16-wide head; every weight and each
    layer's correction bias random."""
    common = hf_common(V, POSITIONS, num_hidden_layers=3, hidden_size=32, intermediate_size=48)
    cfg = transformers.Glm4MoeConfig(
        **common
        | dict(
            head_dim=16,
            moe_intermediate_size=24,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            attention_bias=True,
            use_qk_norm=qk_norm,
            tie_word_embeddings=False,
        )
        | change
    )
    model = hf_perturbed(lambda: transformers.Glm4MoeForCausalLM(cfg))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.2 * torch.randn_like(b))
    return model


def want(qk_norm: bool) -> dict:
    return dict(
        qk_norm="head" if qk_norm else None, qkv_bias=True, bias=False, rotary_dim=8, head_dim=16, d_ff=48
    )


@pytest.mark.parametrize("qk_norm", [False, True])
def test_import_has_the_logits_of_transformers_and_export_gives_back_the_same_files(tmp_path, qk_norm):
    theirs = hf_model(qk_norm)
    model_cfg, model = hf_import(tmp_path, theirs, want(qk_norm))
    m = model_cfg.moe
    assert (m.n_experts, m.top_k, m.d_expert, m.n_shared, m.first_dense) == (4, 2, 24, 1, 1)
    assert (m.router, m.correction_bias, m.n_group, m.topk_group, m.route_scale) == (
        "sigmoid",
        True,
        2,
        1,
        2.5,
    )
    # transformers' save holds no MTP layer: none imported
    assert model_cfg.mtp_depth == 0
    assert torch.equal(
        model.blocks[1].mlp.expert_bias, theirs.model.layers[1].mlp.gate.e_score_correction_bias
    )
    idx = torch.randint(0, V, (2, T))
    with torch.no_grad():
        for attention in ("eager", "sdpa"):
            theirs.set_attn_implementation(attention)
            ref = theirs(idx).logits
            for impl in ("grouped_mm", "loop"):
                d = model_cfg.to_dict()
                d |= {"attention": attention, "moe": d["moe"] | {"impl": impl}}
                ours = GPT.from_state(ModelConfig.from_dict(d), model.state_dict())
                assert (ours(idx).logits - ref).abs().max().item() <= 1e-5, (attention, impl)
    hf_export_same_files(tmp_path, "Glm4MoeForCausalLM", idx, ref)
    # in memory (transformers fuses each layer's experts) and back, exactly
    back = hf.from_transformers(hf.to_transformers(model))
    assert back.cfg == model.cfg
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_greedy_generation_equals_transformers():
    """64 greedy tokens past an 8-token prompt: the tokens of transformers' own generate with its cache."""
    theirs = hf_model(True)
    ours = hf.from_transformers(theirs)
    prompt = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])  # [1, 8]
        want_ids = theirs.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            pad_token_id=0,
        )[0, 8:].tolist()
    got = generate(ours, prompt, SampleOptions(max_new_tokens=64, temperature=0.0, decode="eager")).tokens[0]
    assert len(want_ids) == 64 and len(set(want_ids)) > 3 and got == want_ids


# ---- the MTP layer ------------------------------------------------------------------------------------
def with_mtp_layer(folder, copies: bool = True) -> dict:
    """Add a GLM-4.5 MTP layer (model.layers.3: enorm, hnorm, eh_proj, shared_head.norm, a decoder layer
    like layer 2, random; with `copies`, the copies of the embedding and head the released checkpoints
    hold) to a saved folder; returns the tensors added."""
    f = folder / "model.safetensors"
    state = load_file(f)
    g = torch.Generator().manual_seed(5)
    added = {}
    for k, v in state.items():
        if k.startswith("model.layers.2."):
            added[k.replace("layers.2.", "layers.3.")] = v + 0.2 * torch.randn(v.shape, generator=g)
    h = "model.layers.3."
    for name, shape in (
        ("enorm", (32,)),
        ("hnorm", (32,)),
        ("shared_head.norm", (32,)),
        ("eh_proj", (32, 64)),
    ):
        added[h + name + ".weight"] = 1.0 + 0.2 * torch.randn(shape, generator=g)
    if copies:
        added[h + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        added[h + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state | added, f, metadata={"format": "pt"})
    return added


def reference_mtp_loss(theirs, mtp: dict, idx) -> float:
    """Depth 1's loss on idx[:, :-1] by GLM's MTP (vLLM's glm4_moe_mtp: enorm(embedding of token i + 1) and
    hnorm(the main model's final-normed hidden state) through eh_proj, a decoder layer, shared_head.norm, the
    head), in transformers' modules with the MTP layer's weights; position i predicts token i + 2."""
    glm = transformers.models.glm4_moe.modeling_glm4_moe
    c = theirs.config
    own = {k[len("model.layers.3.") :]: v for k, v in mtp.items()}
    layer = glm.Glm4MoeDecoderLayer(c, layer_idx=1).eval()
    block = {k: v for k, v in own.items() if ".experts." not in k and k.startswith(BLOCK_PARTS)}
    for ours, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        stacks = [torch.stack([own[f"mlp.experts.{j}.{p}.weight"] for j in range(4)]) for p in parts]
        block[f"mlp.experts.{ours}"] = torch.cat(stacks, dim=1)
    layer.load_state_dict(block, strict=True)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = glm.Glm4MoeRMSNorm(32, eps=c.rms_norm_eps)
        norms[name].weight.data.copy_(own[name + ".weight"])
    inp = idx[:, :-1]
    n = inp.shape[1]
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]  # [1, 1, n, n]
    with torch.no_grad():
        h0 = theirs.model(inp).last_hidden_state  # final-normed
        nxt = torch.cat([inp[:, 1:], inp[:, -1:]], dim=1)  # token i + 1 at position i
        e = theirs.model.embed_tokens(nxt)
        x = torch.cat([norms["enorm"](e), norms["hnorm"](h0)], dim=-1) @ own["eh_proj.weight"].t()
        pe = theirs.model.rotary_emb(x, torch.arange(n)[None])
        x = layer(x, position_embeddings=pe, attention_mask=causal)
        logits = theirs.lm_head(norms["shared_head.norm"](x))
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), idx[:, 2:].reshape(-1)).item()


BLOCK_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


@pytest.mark.long
def test_the_mtp_layer_is_kept_when_it_maps_and_exports_back(tmp_path):
    theirs = hf_model(False)
    theirs.save_pretrained(tmp_path / "hf")
    added = with_mtp_layer(tmp_path / "hf")
    r = run_cli("import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    assert "note: its 1 MTP layer(s) kept as model.mtp (depth 1)" in r.stderr
    from gptkit.runs import load_model

    model = load_model(tmp_path / "run")[4]
    assert model.cfg.mtp_depth == 1
    idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # causal attention inside the MTP block: the shifted last position only sees what it may
        out = model(idx[:, :-1], targets=idx[:, 1:], mtp=True)
        ours = out.mtp_losses[0].item()
    ref = reference_mtp_loss(theirs, added, idx)
    assert abs(ours - ref) <= 1e-5, (ours, ref)
    # export writes the MTP layer back under its names (the copies of the embedding and head left out)
    assert run_cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'again'}").returncode == 0
    again = load_file(tmp_path / "again" / "model.safetensors")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    copies = {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    assert sorted(again) == sorted(set(original) - copies)
    assert all(torch.equal(again[k], original[k]) for k in again)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_an_mtp_layer_that_does_not_map_is_dropped_with_a_note_and_a_wrong_shape_is_one_line(tmp_path):
    from gptkit.hf.folders import Source, import_folder
    from gptkit.runs import load_model

    def imported(out: str):
        """(the import's note, its model.mtp depth), in process (the CLI prints the note: the kept case)."""
        done = import_folder(Source(tmp_path / "hf", "x", "x"), tmp_path / out)
        return "; ".join(done.notes or []), load_model(tmp_path / out)[3].mtp_depth

    hf_model(False).save_pretrained(tmp_path / "hf")
    note, depth = imported("plain")
    assert "the files hold no MTP layer" in note and depth == 0
    with_mtp_layer(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    state = load_file(f)
    # a head of its own: gptkit's MTP shares the main one
    head = state["model.layers.3.shared_head.head.weight"]
    save_file(state | {"model.layers.3.shared_head.head.weight": head + 1.0}, f, metadata={"format": "pt"})
    note, depth = imported("own-head")
    assert "shared_head.head.weight is not the main model's lm_head.weight" in note and depth == 0
    assert "imported without model.mtp" in note
    # a tensor gptkit's MTP has no place for, and one it needs left out
    save_file(state | {"model.layers.3.extra.weight": torch.ones(2)}, f, metadata={"format": "pt"})
    note, depth = imported("extra")
    assert "model.layers.3.extra.weight has no place in gptkit's MTP" in note and depth == 0
    save_file({k: v for k, v in state.items() if "layers.3.enorm" not in k}, f, metadata={"format": "pt"})
    note, depth = imported("no-enorm")
    assert "it has no model.layers.3.enorm.weight" in note and depth == 0
    # eh_proj of the wrong width: one line, exit 2, nothing written
    save_file(state | {"model.layers.3.eh_proj.weight": torch.zeros(32, 48)}, f, metadata={"format": "pt"})
    r = run_cli("import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'bad'}")
    one_line_error(r, "model.layers.3.eh_proj.weight has shape (32, 48)", "(32, 64)")
    assert not (tmp_path / "bad").exists()


def test_train_init_from_hf_keeps_the_mtp_layer_and_trains_it(tmp_path, monkeypatch, capsys):
    import csv
    import sys

    from conftest import main_code as cli
    from conftest import shakespeare

    # the Hydra app sets sys.argv
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])
    hf_model(True).save_pretrained(tmp_path / "hf")
    with_mtp_layer(tmp_path / "hf")
    (tmp_path / "c.txt").write_text(shakespeare(20_000).lower())
    args = ["train", f"init_from=hf:{tmp_path / 'hf'}", "tokenizer=char", "data=files"]
    args += [f"data.paths=[{tmp_path / 'c.txt'}]", "trainer.batch_size=2", "trainer.max_steps=2"]
    args += ["trainer.val_windows=2", "trainer.log_every=1", "trainer.progress=false"]
    assert cli(*args, f"runs_dir={tmp_path / 'runs'}", "name=ft") == 0
    assert "MTP layer(s) kept as model.mtp" in capsys.readouterr().err
    with open(tmp_path / "runs/ft/metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["train/loss"]]
    assert len(rows) == 2 and all(r["train/mtp_loss_1"] and r["moe/entropy/1"] for r in rows)


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, named",
    [
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_type"),
        (dict(partial_rotary_factor=0.19), "partial_rotary_factor=0.19"),
        (dict(n_shared_experts=0), "n_shared_experts=0"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(n_group=3), "not divisible by model.moe.n_group=3"),
    ],
)
def test_glm_configs_gptkit_cannot_represent_are_refused_by_name(change, named):
    d = hf_model(False).config.to_dict() | change
    if "partial_rotary_factor" in change:
        # 3 of the 16 features: no even number turns
        d["rope_parameters"] = d["rope_parameters"] | change
    with pytest.raises(GptkitError, match=named.replace(".", r"\.")):
        hf.model_config_from_hf(d)


def test_a_sigmoid_mixture_without_the_correction_bias_is_refused_on_export():
    cfg = hf.from_transformers(hf_model(False)).cfg.to_dict()
    cfg = ModelConfig.from_dict(cfg | {"moe": cfg["moe"] | {"correction_bias": False}})
    with pytest.raises(GptkitError, match="model.moe.correction_bias=False"):
        hf.hf_config(cfg)


# ---- presets and count-params ------------------------------------------------------------------------
# total (the MTP layer included, as the released checkpoints hold it), active (no MTP), the MTP layer
COUNTS = {
    "glm-4.5-air": (109_227_304_960, 13_424_123_904, 2_375_059_456),
    "glm-4.5": (356_785_884_416, 33_632_251_904, 3_988_069_632),
}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_presets_count_total_and_active_as_transformers_builds_them(name):
    """count-params' total less its MTP row, and its active count, are transformers' Glm4MoeForCausalLM's
    (which holds no MTP layer) on the meta device: its parameters, and those a token meets (top_k of the
    n_experts experts)."""
    cfg = ModelConfig.from_dict(yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text()))
    c = acc.count_params(cfg)
    assert (c.total, c.active, c.mtp) == COUNTS[name]
    with torch.device("meta"):
        assert GPT(cfg).num_parameters() == c.total
        d = hf.hf_config(cfg)
        config = transformers.Glm4MoeConfig(
            **{k: v for k, v in d.items() if k not in ("architectures", "dtype", "model_type")}
        )
        theirs = transformers.Glm4MoeForCausalLM(config)
    total = sum(p.numel() for p in theirs.parameters())
    experts = sum(p.numel() for n, p in theirs.named_parameters() if ".experts." in n)
    m = cfg.moe
    assert (total, total - experts * (m.n_experts - m.top_k) // m.n_experts) == (c.total - c.mtp, c.active)
    # config.json alone makes no MTP (the files' layers do: with_files)
    assert hf.model_config_from_hf(config.to_dict(), name=cfg.name) == ModelConfig.from_dict(
        cfg.to_dict() | {"mtp": None}
    )


def parity_table() -> list[str]:
    """The measured differences behind the bounds above, one Markdown row per case (docs/families.md):
    `python tests/hf/test_hf_glm.py`."""
    rows = [
        "| case | eager | sdpa | export (gptkit -> transformers) | greedy tokens equal |",
        "|---|---|---|---|---|",
    ]
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    for qk_norm in (False, True):
        theirs = hf_model(qk_norm)
        model = hf.from_transformers(theirs)
        diffs = []
        with torch.no_grad():
            for attention in ("eager", "sdpa"):
                theirs.set_attn_implementation(attention)
                d = model.cfg.to_dict() | {"attention": attention}
                ours = GPT.from_state(ModelConfig.from_dict(d), model.state_dict())
                diffs.append((ours(idx).logits - theirs(idx).logits).abs().max().item())
            diffs.append((model(idx).logits - hf.to_transformers(model)(idx).logits).abs().max().item())
        cells = " | ".join(f"{x:.1e}" if x else "0.0" for x in diffs)
        rows.append(f"| QK-norm {'on' if qk_norm else 'off'} | {cells} |")
    return rows


if __name__ == "__main__":
    print("\n".join(parity_table()))
