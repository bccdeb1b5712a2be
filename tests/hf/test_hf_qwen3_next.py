"""Qwen3-Next (transformers' Qwen3NextForCausalLM, gptkit/hf/qwen3_next.py): import with transformers' fp32
logits (<= 1e-5; every weight perturbed, three Gated DeltaNet layers and one gated full-attention layer,
partial RoPE, QK-norm, the (1 + w) RMSNorm, a dense first layer, two shared experts behind their sigmoid gate;
T = 80, five chunks of 16 on both sides), greedy tokens of `generate` (the recurrent state and the KV cache),
export back to the same files bit for bit, the MTP module kept (its loss equals a reference in transformers'
modules) or dropped with its note, refusals by name, the preset's counts equal transformers' on the meta
device. Tiny random models built from their configs (no hub); transformers runs its PyTorch path (no
flash-linear-attention, no causal-conv1d)."""

import functools

import pytest
import torch
import yaml
from conftest import hf_common, hf_export_same_files, hf_import, hf_perturbed
from safetensors.torch import load_file, save_file

from gptkit import accounting as acc
from gptkit import hf
from gptkit.conf_tree import conf_dir
from gptkit.errors import GptkitError
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig

transformers = pytest.importorskip("transformers")

V, T = 64, 80
# room to generate 64 tokens past an 8-token prompt
POSITIONS = 96
# gptkit's chunk in the parity check: T is five of them
CHUNK = 16
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def hf_model(**change):
    """A tiny Qwen3NextForCausalLM: 3 linear layers then a full one, the first layer dense, 4 experts top-2,
    a shared expert twice an expert's width, RoPE over half of each 16-wide head; every weight random."""
    common = hf_common(V, POSITIONS, num_hidden_layers=4, hidden_size=32, intermediate_size=48)
    cfg = transformers.Qwen3NextConfig(
        **common
        | dict(
            head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            layer_types=LAYER_TYPES,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            mlp_only_layers=[0],
            tie_word_embeddings=False,
        )
        | change
    )
    return hf_perturbed(lambda: fla_decays(transformers.Qwen3NextForCausalLM(cfg)))


def fla_decays(model):
    """Each linear layer's dt_bias at flash-linear-attention's initialization (softplus(dt_bias) = dt, dt
    log-uniform in [0.001, 0.1]; transformers' own init, dt_bias 1, forgets nearly everything each step):
    decays of the range the chunked form is computed in, where its fp32 rounding stays that of the
    arithmetic, not of exp(-hundreds) underflowing."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                b = layer.linear_attn.dt_bias
                dt = torch.empty_like(b).uniform_(
                    torch.tensor(1e-3).log().item(), torch.tensor(0.1).log().item()
                )
                dt = dt.exp()
                b.copy_(dt + torch.log(-torch.expm1(-dt)))
    return model


WANT = dict(
    norm="rmsnorm_unit_offset",
    qk_norm="head",
    attn_output_gate=True,
    rotary_dim=8,
    head_dim=16,
    d_ff=48,
    layer_types=["linear", "linear", "linear", "global"],
)


def test_no_fast_kernels_are_installed():
    """The parity below is against transformers' PyTorch functions: the kernels it would prefer are absent."""
    import importlib.util

    assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None


def their_chunk(monkeypatch, chunk: int = CHUNK) -> None:
    """transformers' chunked delta rule at `chunk` positions (its forward never passes one: 64 always), so
    that both sides chunk alike and T is five chunks on both: fp32 rounding of one arithmetic."""
    module = transformers.models.qwen3_next.modeling_qwen3_next
    monkeypatch.setattr(
        module,
        "torch_chunk_gated_delta_rule",
        functools.partial(module.torch_chunk_gated_delta_rule, chunk_size=chunk),
    )


def test_import_has_the_logits_of_transformers_and_export_gives_back_the_same_files(tmp_path, monkeypatch):
    their_chunk(monkeypatch)
    theirs = hf_model()
    model_cfg, model = hf_import(tmp_path, theirs, WANT)
    g, m = model_cfg.gdn, model_cfg.moe
    assert (g.n_key_heads, g.n_value_heads, g.key_head_dim, g.value_head_dim, g.conv_kernel) == (
        2,
        4,
        8,
        8,
        4,
    )
    assert (m.n_experts, m.top_k, m.d_expert, m.n_shared, m.first_dense) == (4, 2, 16, 2, 1)
    assert (m.router, m.shared_expert_gate, m.norm_topk_prob) == ("softmax", True, True)
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for attention in ("eager", "sdpa"):
            theirs.set_attn_implementation(attention)
            ref = theirs(idx).logits
            for impl in ("grouped_mm", "loop"):
                d = model_cfg.to_dict()
                d |= {"attention": attention, "moe": d["moe"] | {"impl": impl}}
                d["gdn"] = d["gdn"] | {"chunk_size": CHUNK}
                ours = GPT.from_state(ModelConfig.from_dict(d), model.state_dict())
                assert (ours(idx).logits - ref).abs().max().item() <= 1e-5, (attention, impl)
    hf_export_same_files(tmp_path, "Qwen3NextForCausalLM", idx, ref)
    # in memory (transformers fuses each layer's experts) and back, exactly
    back = hf.from_transformers(hf.to_transformers(model))
    assert back.cfg == model.cfg
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_greedy_generation_equals_transformers():
    """64 greedy tokens past an 8-token prompt: the tokens of transformers' own generate with its cache (each
    linear layer's recurrent and conv state, the full layer's keys and values)."""
    theirs = hf_model()
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


# ---- the MTP module ------------------------------------------------------------------------------------
def with_mtp_module(folder) -> dict:
    """Add a Qwen3-Next MTP module (mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm and
    mtp.layers.0: a decoder layer like layer 3, full attention with experts; random) to a saved folder;
    returns the tensors added."""
    f = folder / "model.safetensors"
    state = load_file(f)
    g = torch.Generator().manual_seed(5)
    added = {}
    for k, v in state.items():
        if k.startswith("model.layers.3."):
            added[k.replace("model.layers.3.", "mtp.layers.0.")] = v + 0.2 * torch.randn(v.shape, generator=g)
    for name, shape in (("pre_fc_norm_embedding", (32,)), ("pre_fc_norm_hidden", (32,)), ("norm", (32,))):
        added[f"mtp.{name}.weight"] = 0.2 * torch.randn(shape, generator=g)
    added["mtp.fc.weight"] = 0.2 * torch.randn((32, 64), generator=g)
    save_file(state | added, f, metadata={"format": "pt"})
    return added


def reference_mtp_loss(theirs, mtp: dict, idx) -> float:
    """Depth 1's loss on idx[:, :-1] by Qwen3-Next's MTP (vLLM's qwen3_next_mtp: fc of
    [pre_fc_norm_embedding(embedding of token i + 1); pre_fc_norm_hidden(the main model's final-normed hidden
    state)], a full-attention decoder layer, norm, the shared head), in transformers' modules with the MTP
    module's weights; position i predicts token i + 2."""
    qn = transformers.models.qwen3_next.modeling_qwen3_next
    c = theirs.config
    own = {k[len("mtp.") :]: v for k, v in mtp.items()}
    layer = qn.Qwen3NextDecoderLayer(c, layer_idx=3).eval()
    block = {
        k[len("layers.0.") :]: v for k, v in own.items() if k.startswith("layers.0.") and ".experts." not in k
    }
    for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        stacks = [torch.stack([own[f"layers.0.mlp.experts.{j}.{p}.weight"] for j in range(4)]) for p in parts]
        block[f"mlp.experts.{fused}"] = torch.cat(stacks, dim=1)
    layer.load_state_dict(block, strict=True)
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = qn.Qwen3NextRMSNorm(32, eps=c.rms_norm_eps)
        norms[name].weight.data.copy_(own[name + ".weight"])
    inp = idx[:, :-1]
    n = inp.shape[1]
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]  # [1, 1, n, n]
    with torch.no_grad():
        h0 = theirs.model(inp).last_hidden_state  # final-normed
        nxt = torch.cat([inp[:, 1:], inp[:, -1:]], dim=1)  # token i + 1 at position i
        e = theirs.model.embed_tokens(nxt)
        x = torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h0)], dim=-1)
        x = x @ own["fc.weight"].t()
        pe = theirs.model.rotary_emb(x, torch.arange(n)[None])
        x = layer(x, position_embeddings=pe, attention_mask=causal)
        logits = theirs.lm_head(norms["norm"](x))
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), idx[:, 2:].reshape(-1)).item()


def imported(tmp_path, out: str):
    """(the import's notes, its model) of tmp_path/hf into tmp_path/out, in process."""
    from gptkit.hf.folders import Source, import_folder
    from gptkit.runs import load_model

    done = import_folder(Source(tmp_path / "hf", "x", "x"), tmp_path / out)
    return "; ".join(done.notes or []), load_model(tmp_path / out)[4]


def test_the_mtp_module_is_kept_when_it_maps_and_exports_back(tmp_path, monkeypatch):
    from gptkit.cli import main

    their_chunk(monkeypatch)
    theirs = hf_model()
    theirs.save_pretrained(tmp_path / "hf")
    added = with_mtp_module(tmp_path / "hf")
    note, model = imported(tmp_path, "run")
    assert "its MTP module (mtp.*) kept as model.mtp (depth 1)" in note and model.cfg.mtp_depth == 1
    d = model.cfg.to_dict()
    model = GPT.from_state(
        ModelConfig.from_dict(d | {"gdn": d["gdn"] | {"chunk_size": CHUNK}}), model.state_dict()
    )
    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx[:, :-1], targets=idx[:, 1:], mtp=True).mtp_losses[0].item()
    ref = reference_mtp_loss(theirs, added, idx)
    assert abs(ours - ref) <= 1e-5, (ours, ref)
    # export writes the MTP module back under its names, bit for bit; transformers ignores it
    assert main(["export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'again'}"]) == 0
    again, original = (
        load_file(tmp_path / "again" / "model.safetensors"),
        load_file(tmp_path / "hf" / "model.safetensors"),
    )
    assert sorted(again) == sorted(original) and all(torch.equal(again[k], original[k]) for k in again)


def test_an_mtp_module_that_does_not_map_is_dropped_with_a_note_and_a_wrong_shape_is_one_line(tmp_path):
    theirs = hf_model()
    theirs.save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    state = load_file(f)
    with_mtp_module(tmp_path / "hf")
    full = load_file(f)
    # a tensor gptkit's MTP has no place for, and one it needs left out: dropped, the main model imported
    save_file(full | {"mtp.extra.weight": torch.ones(2)}, f, metadata={"format": "pt"})
    note, model = imported(tmp_path, "extra")
    assert "mtp.extra.weight has no place in gptkit's MTP" in note and model.cfg.mtp_depth == 0
    assert "imported without model.mtp" in note
    save_file({k: v for k, v in full.items() if k != "mtp.fc.weight"}, f, metadata={"format": "pt"})
    note, model = imported(tmp_path, "no-fc")
    assert "it has no mtp.fc.weight" in note and model.cfg.mtp_depth == 0
    idx = torch.randint(0, V, (1, 24))
    with torch.no_grad():
        assert (model(idx).logits - theirs(idx).logits).abs().max().item() <= 1e-5
    # fc of the wrong width: one line, nothing written
    save_file(full | {"mtp.fc.weight": torch.zeros(32, 48)}, f, metadata={"format": "pt"})
    with pytest.raises(
        GptkitError, match=r"the MTP tensor mtp\.fc\.weight has shape \(32, 48\), the config needs \(32, 64\)"
    ):
        imported(tmp_path, "bad")
    assert not (tmp_path / "bad").exists()
    save_file(state, f, metadata={"format": "pt"})


def test_train_init_from_hf_trains_the_hybrid(tmp_path, monkeypatch, capsys):
    """`train init_from=hf:` of a Qwen3-Next folder: every layer kind and the gated shared expert train."""
    import csv
    import sys

    from conftest import main_code as cli
    from conftest import shakespeare

    # the Hydra app sets sys.argv
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])
    hf_model().save_pretrained(tmp_path / "hf")
    (tmp_path / "c.txt").write_text(shakespeare(20_000).lower())
    args = ["train", f"init_from=hf:{tmp_path / 'hf'}", "tokenizer=char", "data=files"]
    args += [f"data.paths=[{tmp_path / 'c.txt'}]", "trainer.batch_size=2", "trainer.max_steps=2"]
    args += ["trainer.val_windows=2", "trainer.log_every=1", "trainer.progress=false"]
    assert cli(*args, f"runs_dir={tmp_path / 'runs'}", "name=ft") == 0
    with open(tmp_path / "runs/ft/metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["train/loss"]]
    assert len(rows) == 2 and all(float(r["train/loss"]) > 0 for r in rows)


def test_a_tensor_of_another_shape_than_config_json_gives_is_one_line(tmp_path):
    """A linear layer's projection of the wrong width: one GptkitError line naming it, nothing written."""
    from gptkit.hf.folders import Source, import_folder

    hf_model().save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    name = "model.layers.1.linear_attn.in_proj_qkvz.weight"
    save_file(load_file(f) | {name: torch.zeros(40, 32)}, f, metadata={"format": "pt"})
    with pytest.raises(
        GptkitError, match=rf"{name.replace('.', '[.]')} has shape \(40, 32\), the config needs \(96, 32\)"
    ):
        import_folder(Source(tmp_path / "hf", "x", "x"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, named",
    [
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_type"),
        (dict(partial_rotary_factor=0.19), "partial_rotary_factor=0.19"),
        (dict(shared_expert_intermediate_size=24), "shared_expert_intermediate_size=24"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(mlp_only_layers=[2]), "mlp_only_layers=[2]"),
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types"),
    ],
)
def test_qwen3_next_configs_gptkit_cannot_represent_are_refused_by_name(change, named):
    d = hf_model().config.to_dict() | change
    if "partial_rotary_factor" in change:
        # 3 of the 16 features: no even number turns
        d["rope_parameters"] = d["rope_parameters"] | change
    with pytest.raises(GptkitError, match=named.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        hf.model_config_from_hf(d)


def test_models_qwen3_next_does_not_express_are_refused_on_export_by_name():
    cfg = hf.from_transformers(hf_model()).cfg.to_dict()
    # the shared expert added as it is (DeepSeek's): Qwen3-Next always gates it
    ungated = ModelConfig.from_dict(cfg | {"moe": cfg["moe"] | {"shared_expert_gate": False}})
    with pytest.raises(GptkitError, match=r"model.moe.shared_expert_gate=False .* Qwen3NextForCausalLM"):
        hf.hf_config(ungated)
    # the plain RMSNorm (gdn-tiny's): Qwen3-Next's norms are all (1 + w)
    plain = ModelConfig.from_dict(cfg | {"norm": "rmsnorm"})
    with pytest.raises(GptkitError, match=r"model.norm=rmsnorm .* needs norm=rmsnorm_unit_offset"):
        hf.hf_config(plain)


def test_a_dense_hybrid_exports_with_num_experts_0_and_reads_back():
    """No mixture: every layer Qwen3NextMLP (num_experts 0), the same logits in transformers."""
    cfg = hf.from_transformers(hf_model()).cfg.to_dict() | {"moe": None}
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_dict(cfg)).eval()
    theirs = hf.to_transformers(model)
    assert hf.hf_config(model.cfg)["num_experts"] == 0
    idx = torch.randint(0, V, (1, 40))
    with torch.no_grad():
        assert (model(idx).logits - theirs(idx).logits).abs().max().item() <= 1e-5
    assert hf.from_transformers(theirs).cfg == model.cfg


def test_lora_adapters_on_the_gated_q_proj_are_refused_in_peft_layout_in_one_line():
    """q_proj packs each head's query and gate rows: no PEFT layout (was a KeyError on qkv_proj)."""
    from gptkit.hf.peft import peft_adapters

    cfg = hf.from_transformers(hf_model(layer_types=["full_attention"] * 4)).cfg
    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q", "v"]}
    with pytest.raises(
        GptkitError, match=r"lora.targets \[.q., .v.\] with model.attn_output_gate: .*\(adapters=false\)"
    ):
        peft_adapters({}, cfg, lora)


# ---- the preset and count-params ------------------------------------------------------------------------
# total (the MTP layer included, as the released checkpoints hold it), active (no MTP), the MTP layer
COUNTS = {"qwen3-next-80b-a3b": (81_324_862_720, 3_874_929_408, 1_650_471_424)}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_presets_count_total_and_active_as_transformers_builds_them(name):
    """count-params' total less its MTP row, and its active count, are transformers' Qwen3NextForCausalLM's
    (which holds no MTP layer) on the meta device: its parameters, and those a token meets (top_k of the
    n_experts routed experts)."""
    cfg = ModelConfig.from_dict(yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text()))
    c = acc.count_params(cfg)
    assert (c.total, c.active, c.mtp) == COUNTS[name]
    with torch.device("meta"):
        assert GPT(cfg).num_parameters() == c.total
        d = hf.hf_config(cfg)
        config = transformers.Qwen3NextConfig(
            **{k: v for k, v in d.items() if k not in ("architectures", "dtype", "model_type")}
        )
        theirs = transformers.Qwen3NextForCausalLM(config)
    total = sum(p.numel() for p in theirs.parameters())
    experts = sum(p.numel() for n, p in theirs.named_parameters() if ".experts." in n)
    m = cfg.moe
    assert (total, total - experts * (m.n_experts - m.top_k) // m.n_experts) == (c.total - c.mtp, c.active)
    # config.json alone makes no MTP (the files' mtp.* do: with_files)
    cfg = ModelConfig.from_dict(cfg.to_dict() | {"mtp": None})
    assert hf.model_config_from_hf(config.to_dict(), name=cfg.name) == cfg
    # the released config.json's spelling: RoPE keys at the top, full_attention_interval, no layer_types
    released = {k: v for k, v in config.to_dict().items() if k not in ("layer_types", "rope_parameters")}
    released |= {"rope_theta": cfg.rope_theta, "partial_rotary_factor": 0.25, "full_attention_interval": 4}
    assert hf.model_config_from_hf(released, name=cfg.name) == cfg


def parity_table() -> list[str]:
    """The measured differences behind the bounds above, one Markdown row per chunking (docs/families.md):
    `PYTHONPATH=tests python tests/hf/test_hf_qwen3_next.py`."""
    module = transformers.models.qwen3_next.modeling_qwen3_next
    original = module.torch_chunk_gated_delta_rule
    rows = [
        "| chunk (gptkit / transformers) | eager | sdpa | export (gptkit -> transformers) |",
        "|---|---|---|---|",
    ]
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    theirs = hf_model()
    model = hf.from_transformers(theirs)
    for ours_chunk, their in ((CHUNK, CHUNK), (64, 64), (CHUNK, 64)):
        module.torch_chunk_gated_delta_rule = functools.partial(original, chunk_size=their)
        d = model.cfg.to_dict()
        d["gdn"] = d["gdn"] | {"chunk_size": ours_chunk}
        diffs = []
        with torch.no_grad():
            for attention in ("eager", "sdpa"):
                theirs.set_attn_implementation(attention)
                ours = GPT.from_state(ModelConfig.from_dict(d | {"attention": attention}), model.state_dict())
                diffs.append((ours(idx).logits - theirs(idx).logits).abs().max().item())
            ours = GPT.from_state(ModelConfig.from_dict(d), model.state_dict())
            diffs.append((ours(idx).logits - hf.to_transformers(ours)(idx).logits).abs().max().item())
        cells = " | ".join(f"{x:.1e}" if x else "0.0" for x in diffs)
        rows.append(f"| {ours_chunk} / {their} | {cells} |")
    module.torch_chunk_gated_delta_rule = original
    return rows


if __name__ == "__main__":
    print("\n".join(parity_table()))
