"""Qwen3.5's language model (transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM; the Qwen3_5
classes of gptkit/hf/qwen3_next.py): import with transformers' fp32 logits (<= 1e-5; every weight perturbed,
three Gated DeltaNet layers with the split projections and one gated full-attention layer, interleaved M-RoPE
over half of each head; T = 64, four chunks of 16 on both sides), dense and MoE; a packed row equal to its
documents apart; greedy tokens of `generate`; export back to the same files bit for bit; the composite
checkpoint (with a vision tower) read for its language model with a note, its MTP module kept; refusals in one
line; the presets' counts equal transformers' on the meta device. Tiny random models built from their configs
(no hub); transformers runs its PyTorch path (no flash-linear-attention, no causal-conv1d)."""

import functools
import json

import pytest
import torch
import yaml
from conftest import hf_common, hf_export_same_files, hf_import, hf_perturbed, run_main
from safetensors.torch import load_file, save_file

from gptkit import accounting as acc
from gptkit import hf
from gptkit.conf_tree import conf_dir
from gptkit.errors import GptkitError
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig

transformers = pytest.importorskip("transformers")

V, T = 64, 64
POSITIONS = 96
CHUNK = 16
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# M-RoPE sections (of the 4 frequency pairs) and their interleaving: text positions make them plain RoPE
MROPE = ROPE | {"mrope_section": [2, 1, 1], "mrope_interleaved": True}


def text_config(moe: bool, **change) -> dict:
    common = hf_common(V, POSITIONS, num_hidden_layers=4, hidden_size=32, intermediate_size=48)
    d = common | dict(
        head_dim=16,
        rope_parameters=MROPE,
        layer_types=LAYER_TYPES,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
    )
    if moe:
        d = {k: v for k, v in d.items() if k != "intermediate_size"}
        d |= dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32
        )
    return d | change


def hf_model(moe: bool = False, **change):
    """A tiny Qwen3_5ForCausalLM (or Qwen3_5MoeForCausalLM: 4 experts top-2, a gated shared expert twice an
    expert's width): 3 linear layers then a full one, RoPE over half of each 16-wide head; every weight
    random."""
    if moe:
        cfg = transformers.Qwen3_5MoeTextConfig(**text_config(True, **change))
        return hf_perturbed(lambda: fla_decays(transformers.Qwen3_5MoeForCausalLM(cfg)))
    cfg = transformers.Qwen3_5TextConfig(**text_config(False, **change))
    return hf_perturbed(lambda: fla_decays(transformers.Qwen3_5ForCausalLM(cfg)))


def fla_decays(model):
    """Each linear layer's dt_bias at flash-linear-attention's initialization (test_hf_qwen3_next.py's
    fla_decays: decays in the range the chunked form computes in); the text model's or a composite's language
    model's."""
    layers = getattr(model.model, "language_model", model.model).layers
    with torch.no_grad():
        for layer in layers:
            if hasattr(layer, "linear_attn"):
                b = layer.linear_attn.dt_bias
                dt = torch.empty_like(b).uniform_(
                    torch.tensor(1e-3).log().item(), torch.tensor(0.1).log().item()
                )
                dt = dt.exp()
                b.copy_(dt + torch.log(-torch.expm1(-dt)))
    return model


def their_chunk(monkeypatch, moe: bool, chunk: int = CHUNK) -> None:
    """transformers' chunked delta rule at `chunk` positions (its forward passes none: 64 always)."""
    module = (
        transformers.models.qwen3_5_moe.modeling_qwen3_5_moe
        if moe
        else transformers.models.qwen3_5.modeling_qwen3_5
    )
    monkeypatch.setattr(
        module,
        "torch_chunk_gated_delta_rule",
        functools.partial(module.torch_chunk_gated_delta_rule, chunk_size=chunk),
    )


WANT = dict(
    norm="rmsnorm_unit_offset",
    qk_norm="head",
    attn_output_gate=True,
    rotary_dim=8,
    head_dim=16,
    layer_types=["linear", "linear", "linear", "global"],
)


def test_text_positions_make_interleaved_mrope_plain_partial_rope():
    """Qwen3_5TextRotaryEmbedding with the same position in its three sections (text: transformers expands
    2-D position_ids so) gives Qwen3-Next's partial RoPE cos/sin exactly, whatever mrope_section says; other
    positions per section (images) would not, and gptkit reads text only."""
    pos = torch.arange(40)[None]
    x = torch.zeros(1, 40, 32)
    c = transformers.Qwen3_5TextConfig(**text_config(False))
    plain = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRotaryEmbedding(
        transformers.Qwen3NextConfig(**text_config(False, rope_parameters=ROPE))
    )
    want = plain(x, pos)
    for section in ([2, 1, 1], [1, 1, 2], [4, 0, 0]):
        c.rope_parameters = MROPE | {"mrope_section": section}
        mrope = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(c)
        got = mrope(x, pos[None].expand(3, 1, -1))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), section
    # a vision token's three positions differ: not plain RoPE (what gptkit's text model never sees)
    c.rope_parameters = MROPE
    mrope = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(c)
    assert not torch.equal(mrope(x, torch.stack([pos, pos * 2, pos * 3]))[0], want[0])


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_import_has_the_logits_of_transformers_and_export_gives_back_the_same_files(
    tmp_path, monkeypatch, moe
):
    their_chunk(monkeypatch, moe)
    theirs = hf_model(moe)
    model_cfg, model = hf_import(tmp_path, theirs, WANT)
    g = model_cfg.gdn
    assert (g.n_key_heads, g.n_value_heads, g.key_head_dim, g.value_head_dim, g.layout) == (
        2,
        4,
        8,
        8,
        "split",
    )
    if moe:
        m = model_cfg.moe
        assert (m.n_experts, m.top_k, m.d_expert, m.n_shared, m.first_dense, m.every) == (4, 2, 16, 2, 0, 1)
        assert (m.router, m.shared_expert_gate, m.norm_topk_prob) == ("softmax", True, True)
    else:
        assert model_cfg.moe is None and model_cfg.d_ff == 48
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    d = model_cfg.to_dict()
    d["gdn"] = d["gdn"] | {"chunk_size": CHUNK}
    with torch.no_grad():
        for attention in ("eager", "sdpa"):
            theirs.set_attn_implementation(attention)
            ref = theirs(idx).logits
            ours = GPT.from_state(ModelConfig.from_dict(d | {"attention": attention}), model.state_dict())
            assert (ours(idx).logits - ref).abs().max().item() <= 1e-5, attention
    hf_export_same_files(tmp_path, "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM", idx, ref)
    back = hf.from_transformers(hf.to_transformers(model))
    assert back.cfg == model.cfg
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_packed_row_equals_its_documents_apart_and_they_equal_transformers(monkeypatch, moe):
    """doc_ids with position_reset: the packed row's documents (one starting mid-chunk, one on a chunk
    boundary) are the documents run apart, and those are transformers' logits of each document alone."""
    their_chunk(monkeypatch, moe)
    theirs = hf_model(moe)
    imported = hf.from_transformers(theirs)
    d = imported.cfg.to_dict()
    model = GPT.from_state(
        ModelConfig.from_dict(d | {"position_reset": True, "gdn": d["gdn"] | {"chunk_size": CHUNK}}),
        imported.state_dict(),
    ).eval()
    seq = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(2))
    bounds = [0, 21, 48, T]
    doc_ids = torch.zeros(1, T, dtype=torch.long)
    for n, a in enumerate(bounds[1:-1], start=1):
        doc_ids[:, a:] = n
    with torch.no_grad():
        packed = model(seq, doc_ids=doc_ids).logits
        for a, b in zip(bounds, bounds[1:]):
            alone = model(seq[:, a:b]).logits
            # fp32 rounding through three linear layers (a document mid-chunk, shorter than the chunks
            # of T), not a systematic gap: measured <= 1.0e-5 and <= 1.9e-5 (docs/hf.md); transformers'
            # own logits at chunk 16 and 64 differ by 2.8e-5 on this model
            assert (packed[:, a:b] - alone).abs().max().item() <= 2e-5, (a, b)
            assert (alone - theirs(seq[:, a:b]).logits).abs().max().item() <= 2e-5, (a, b)
        # without the reset the second document reads the first
        assert (model(seq).logits[:, 21:48] - packed[:, 21:48]).abs().max().item() > 1e-3


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_generation_equals_transformers(moe):
    """64 greedy tokens past an 8-token prompt equal transformers' generate with its cache."""
    theirs = hf_model(moe)
    ours = hf.from_transformers(theirs)
    prompt = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = theirs.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            pad_token_id=0,
        )[0, 8:].tolist()
    got = generate(ours, prompt, SampleOptions(max_new_tokens=64, temperature=0.0, decode="eager")).tokens[0]
    assert len(want) == 64 and len(set(want)) > 3 and got == want


def test_tied_embeddings_import_and_export():
    """The small Qwen3.5 sizes tie the head to the embedding: read and written so."""
    theirs = hf_model(tie_word_embeddings=True)
    ours = hf.from_transformers(theirs)
    assert ours.cfg.tie_embeddings
    idx = torch.randint(0, V, (1, 24))
    with torch.no_grad():
        assert (ours(idx).logits - theirs(idx).logits).abs().max().item() <= 1e-5
        assert (hf.to_transformers(ours)(idx).logits - theirs(idx).logits).abs().max().item() <= 1e-5


# ---- the composite checkpoint (a vision tower beside the language model) --------------------------------
def composite_folder(tmp_path, theirs, moe: bool = False, tie: bool = False):
    """theirs saved as Qwen3_5ForConditionalGeneration's files would hold it: config.json qwen3_5 with
    text_config (and a vision_config), the language model under model.language_model., a vision tensor under
    model.visual., and an MTP module (mtp.*: fc, two input norms, a full-attention layer, norm)."""
    folder = tmp_path / "hf"
    theirs.save_pretrained(folder)
    f = folder / "model.safetensors"
    state = load_file(f)
    g = torch.Generator().manual_seed(5)
    mtp = {
        k.replace("model.layers.3.", "mtp.layers.0."): v + 0.2 * torch.randn(v.shape, generator=g)
        for k, v in state.items()
        if k.startswith("model.layers.3.")
    }
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = 0.2 * torch.randn((32,), generator=g)
    mtp["mtp.fc.weight"] = 0.2 * torch.randn((32, 64), generator=g)
    renamed = {
        ("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in state.items()
    }
    save_file(
        renamed | mtp | {"model.visual.patch_embed.proj.weight": torch.ones(4, 3)},
        f,
        metadata={"format": "pt"},
    )
    text = json.loads((folder / "config.json").read_text())
    text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": {k: v for k, v in text.items() if k not in ("architectures", "tie_word_embeddings")},
        "vision_config": {"depth": 1, "hidden_size": 8},
        "tie_word_embeddings": tie,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder, mtp


def imported(tmp_path, out: str):
    from gptkit.hf.folders import Source, import_folder
    from gptkit.runs import load_model

    done = import_folder(Source(tmp_path / "hf", "x", "x"), tmp_path / out)
    # the heads text_config sets, which the weights' shapes confirm
    assert done.heads.endswith("confirmed by the q/k/v weight shapes (config.json sets head_dim)"), done.heads
    return "; ".join(done.notes or []), load_model(tmp_path / out)[4]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_composite_checkpoint_imports_its_language_model_with_notes_and_exports_the_text_model(
    tmp_path, moe
):
    from gptkit.cli import main

    theirs = hf_model(moe)
    folder, mtp = composite_folder(tmp_path, theirs, moe)
    note, model = imported(tmp_path, "run")
    assert "the vision tower (1 model.visual.* tensors) was not imported" in note
    assert "its MTP module (mtp.*) kept as model.mtp (depth 1)" in note and model.cfg.mtp_depth == 1
    idx = torch.randint(0, V, (1, 40))
    with torch.no_grad():
        assert (model(idx).logits - theirs(idx).logits).abs().max().item() <= 1e-5
    # export: the text model's files (model.*, mtp.* as they were), which Qwen3_5ForCausalLM loads
    assert main(["export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'again'}"]) == 0
    again = load_file(tmp_path / "again" / "model.safetensors")
    want = {k: v for k, v in theirs.state_dict().items() if not k.endswith("experts.gate_up_proj")}
    want = {k: v for k, v in want.items() if not k.endswith("experts.down_proj")}
    assert all(torch.equal(again[k], v) for k, v in want.items())
    assert all(torch.equal(again[k], v) for k, v in mtp.items())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert type(reloaded).__name__ == ("Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM")
    with torch.no_grad():
        assert (reloaded(idx).logits - theirs(idx).logits).abs().max().item() == 0.0


def test_the_kept_mtp_module_s_loss_equals_the_same_computation_in_transformers_modules(tmp_path):
    """Depth 1's loss on idx[:, :-1] by Qwen3.5's MTP (vLLM's qwen3_5_mtp: fc of [pre_fc_norm_embedding(the
    embedding of token i + 1); pre_fc_norm_hidden(the final-normed hidden state)], a full-attention decoder
    layer, norm, the shared head), computed in transformers' Qwen3.5 modules with the files' MTP weights."""
    qn = transformers.models.qwen3_5.modeling_qwen3_5
    theirs = hf_model()
    _, mtp = composite_folder(tmp_path, theirs)
    _, model = imported(tmp_path, "run")
    own = {k[len("mtp.") :]: v for k, v in mtp.items()}
    layer = qn.Qwen3_5DecoderLayer(theirs.config, layer_idx=3).eval()
    layer.load_state_dict({k[len("layers.0.") :]: v for k, v in own.items() if k.startswith("layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = qn.Qwen3_5RMSNorm(32, eps=theirs.config.rms_norm_eps)
        norms[name].weight.data.copy_(own[name + ".weight"])
    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))
    inp = idx[:, :-1]
    n = inp.shape[1]
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        h0 = theirs.model(inp).last_hidden_state
        e = theirs.model.embed_tokens(torch.cat([inp[:, 1:], inp[:, -1:]], dim=1))  # token i + 1 at i
        x = torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h0)], dim=-1)
        x = x @ own["fc.weight"].t()
        pe = theirs.model.rotary_emb(x, torch.arange(n)[None, None].expand(3, 1, -1))
        x = layer(x, position_embeddings=pe, attention_mask=causal)
        logits = theirs.lm_head(norms["norm"](x))
        ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), idx[:, 2:].reshape(-1)).item()
        ours = model(inp, targets=idx[:, 1:], mtp=True).mtp_losses[0].item()
    assert abs(ours - ref) <= 1e-5, (ours, ref)


def test_experts_fused_in_the_files_as_transformers_holds_them_import_the_mtp_layer_s_too(tmp_path):
    """Files whose experts are fused per layer (experts.gate_up_proj [E, 2 x d_expert, d_model], gate rows
    first, and experts.down_proj), the MTP layer's too, as vLLM's Qwen3.5 loader reads them: the same model,
    its MTP module kept."""
    theirs = hf_model(True)
    folder, mtp = composite_folder(tmp_path, theirs, moe=True)
    f = folder / "model.safetensors"
    state = load_file(f)
    mixtures = {k.split("experts.")[0] for k in state if ".mlp.experts." in k}
    assert "mtp.layers.0.mlp." in mixtures and len(mixtures) == 5
    for moe in mixtures:
        stack = {
            p: torch.stack([state.pop(f"{moe}experts.{j}.{p}.weight") for j in range(4)])
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        state[moe + "experts.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        state[moe + "experts.down_proj"] = stack["down_proj"]
    save_file(state, f, metadata={"format": "pt"})
    note, model = imported(tmp_path, "run")
    assert "its MTP module (mtp.*) kept as model.mtp (depth 1)" in note, note
    mine = model.state_dict()
    assert torch.equal(
        mine["mtp.layers.0.block.mlp.experts.up_proj"][3], mtp["mtp.layers.0.mlp.experts.3.up_proj.weight"]
    )
    idx = torch.randint(0, V, (1, 40))
    with torch.no_grad():
        assert (model(idx).logits - theirs(idx).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_transformers_own_composite_model_imports_in_memory_and_from_its_saved_folder(tmp_path, moe):
    """Qwen3_5ForConditionalGeneration (and its MoE) built by transformers with a tiny vision tower: its
    language model in memory (from_transformers) and from the folder save_pretrained writes (`gptkit
    import`, the vision tower left out with a note) has its text logits."""
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2
    )
    config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_cls = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    cfg = config_cls(text_config=text_config(moe), vision_config=vision | {"num_position_embeddings": 16})
    theirs = hf_perturbed(lambda: fla_decays(model_cls(cfg)))
    idx = torch.randint(0, V, (1, 24))
    with torch.no_grad():
        ref = theirs(input_ids=idx).logits
        assert (hf.from_transformers(theirs)(idx).logits - ref).abs().max().item() <= 1e-5
    theirs.save_pretrained(tmp_path / "hf")
    note, model = imported(tmp_path, "run")
    assert "model.visual.* tensors) was not imported" in note and model.cfg.gdn.layout == "split"
    with torch.no_grad():
        assert (model(idx).logits - ref).abs().max().item() <= 1e-5


def test_a_composite_checkpoint_ties_by_its_top_level_flag(tmp_path):
    theirs = hf_model(tie_word_embeddings=True)
    composite_folder(tmp_path, theirs, tie=True)
    _, model = imported(tmp_path, "run")
    assert model.cfg.tie_embeddings


# ---- bad input: one line ---------------------------------------------------------------------------------
def cli_error(capsys, *argv) -> str:
    """The one `error:` line of a gptkit command that exits 2."""
    code, _, err = run_main(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


def test_a_vision_only_checkpoint_is_one_line(tmp_path, capsys):
    folder, _ = composite_folder(tmp_path, hf_model())
    f = folder / "model.safetensors"
    save_file({"model.visual.patch_embed.proj.weight": torch.ones(4, 3)}, f, metadata={"format": "pt"})
    err = cli_error(capsys, "import", f"hf={folder}", f"out={tmp_path / 'run'}")
    assert "holds a vision tower (model.visual.*) and no language model" in err
    assert not (tmp_path / "run").exists()
    # no text_config at all
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "vision_config": {}}))
    assert "qwen3_5 config.json has no text_config" in cli_error(
        capsys, "import", f"hf={folder}", f"out={tmp_path / 'r'}"
    )


def test_a_projection_or_conv_of_another_shape_than_config_json_is_one_line(tmp_path, capsys):
    folder = tmp_path / "hf"
    hf_model().save_pretrained(folder)
    f = folder / "model.safetensors"
    full = load_file(f)
    for name, shape, need in (
        ("model.layers.1.linear_attn.in_proj_qkv.weight", (40, 32), "(64, 32)"),
        ("model.layers.0.linear_attn.conv1d.weight", (64, 1, 3), "(64, 1, 4)"),
        ("model.layers.2.linear_attn.in_proj_b.weight", (2, 32), "(4, 32)"),
    ):
        save_file(full | {name: torch.zeros(shape)}, f, metadata={"format": "pt"})
        err = cli_error(capsys, "import", f"hf={folder}", f"out={tmp_path / 'run'}")
        assert f"{name} has shape {shape}, the config needs {need}" in err
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(rope_parameters=MROPE | {"rope_type": "yarn", "factor": 4.0}), "rope_type"),
        (dict(rope_parameters=MROPE | {"mrope_section": "2,1,1"}), "mrope_section"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias=True"),
    ],
)
def test_qwen3_5_configs_gptkit_cannot_represent_are_refused_by_name(change, named):
    d = hf_model().config.to_dict() | change
    with pytest.raises(GptkitError, match=named):
        hf.model_config_from_hf(d)


def test_models_qwen3_5_moe_does_not_express_are_refused_on_export_by_name():
    cfg = hf.from_transformers(hf_model(True)).cfg.to_dict()
    # Qwen3_5MoeSparseMoeBlock always renormalizes the top-k weights and has a mixture in every layer
    for field, value in (("norm_topk_prob", False), ("first_dense", 1)):
        c = ModelConfig.from_dict(cfg | {"moe": cfg["moe"] | {field: value}})
        with pytest.raises(GptkitError, match=rf"model.moe.{field}={value} .* Qwen3_5MoeForCausalLM"):
            hf.hf_config(c)


# ---- the presets ------------------------------------------------------------------------------------------
COUNTS = {"qwen3.5-9b": (8_953_803_264, 8_953_803_264), "qwen3.5-35b-a3b": (34_660_610_688, 3_454_988_928)}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_presets_count_total_and_active_as_transformers_builds_them(name):
    """count-params' total and active are transformers' model's of the preset's config.json on the meta
    device, and that config.json is the config class's defaults (what the preset says it mirrors)."""
    cfg = ModelConfig.from_dict(yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text()))
    c = acc.count_params(cfg)
    assert (c.total, c.active) == COUNTS[name]
    family = hf.family_of(cfg)
    config_cls = getattr(transformers, family.config_class)
    with torch.device("meta"):
        assert GPT(cfg).num_parameters() == c.total
        d = hf.hf_config(cfg)
        config = config_cls(
            **{k: v for k, v in d.items() if k not in ("architectures", "dtype", "model_type")}
        )
        theirs = getattr(transformers, family.architecture)(config)
    total = sum(p.numel() for p in theirs.parameters())
    experts = sum(p.numel() for n, p in theirs.named_parameters() if ".experts." in n)
    m = cfg.moe
    inactive = 0 if m is None else experts * (m.n_experts - m.top_k) // m.n_experts
    assert (total, total - inactive) == (c.total, c.active)
    assert hf.model_config_from_hf(config.to_dict(), name=cfg.name) == cfg
    # the class's defaults are the preset (rope_theta, context and all)
    assert hf.model_config_from_hf(config_cls().to_dict(), name=cfg.name) == cfg


def test_train_init_from_hf_of_a_composite_checkpoint_trains_its_language_model(tmp_path, monkeypatch):
    """`train init_from=hf:` of a Qwen3.5 folder with a vision tower and an MTP module: the language model
    (and its MTP module) trains."""
    import csv
    import sys

    from conftest import main_code as cli
    from conftest import shakespeare

    # the Hydra app sets sys.argv
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])
    composite_folder(tmp_path, hf_model(True), moe=True)
    (tmp_path / "c.txt").write_text(shakespeare(20_000).lower())
    args = ["train", f"init_from=hf:{tmp_path / 'hf'}", "tokenizer=char", "data=files"]
    args += [f"data.paths=[{tmp_path / 'c.txt'}]", "trainer.batch_size=2", "trainer.max_steps=2"]
    args += ["trainer.val_windows=2", "trainer.log_every=1", "trainer.progress=false"]
    assert cli(*args, f"runs_dir={tmp_path / 'runs'}", "name=ft") == 0
    with open(tmp_path / "runs/ft/metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["train/loss"]]
    assert len(rows) == 2 and all(float(r["train/loss"]) > 0 for r in rows)
    config = yaml.safe_load((tmp_path / "runs/ft/config.yaml").read_text())
    assert config["model"]["gdn"]["layout"] == "split" and config["model"]["mtp"]["depth"] == 1


def parity_table() -> list[str]:
    """The measured differences behind the bounds above, one Markdown row per model and chunking (docs/hf.md):
    `PYTHONPATH=tests python tests/hf/test_hf_qwen3_5.py`."""
    rows = ["| model | chunk (gptkit / transformers) | eager | sdpa | export (gptkit -> transformers) |"]
    rows.append("|---|---|---|---|---|")
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    for moe in (False, True):
        module = (
            transformers.models.qwen3_5_moe.modeling_qwen3_5_moe
            if moe
            else transformers.models.qwen3_5.modeling_qwen3_5
        )
        original = module.torch_chunk_gated_delta_rule
        theirs = hf_model(moe)
        model = hf.from_transformers(theirs)
        for ours_chunk, their in ((CHUNK, CHUNK), (64, 64)):
            module.torch_chunk_gated_delta_rule = functools.partial(original, chunk_size=their)
            d = model.cfg.to_dict()
            d["gdn"] = d["gdn"] | {"chunk_size": ours_chunk}
            diffs = []
            with torch.no_grad():
                for attention in ("eager", "sdpa"):
                    theirs.set_attn_implementation(attention)
                    ours = GPT.from_state(
                        ModelConfig.from_dict(d | {"attention": attention}), model.state_dict()
                    )
                    diffs.append((ours(idx).logits - theirs(idx).logits).abs().max().item())
                ours = GPT.from_state(ModelConfig.from_dict(d), model.state_dict())
                diffs.append((ours(idx).logits - hf.to_transformers(ours)(idx).logits).abs().max().item())
            cells = " | ".join(f"{x:.1e}" if x else "0.0" for x in diffs)
            rows.append(f"| {'MoE' if moe else 'dense'} | {ours_chunk} / {their} | {cells} |")
        module.torch_chunk_gated_delta_rule = original
    return rows


if __name__ == "__main__":
    print("\n".join(parity_table()))
