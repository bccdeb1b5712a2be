"""gpt-oss (GptOssForCausalLM) against transformers: attention sinks, q/k/v/o biases, the router's bias, every
expert's biases, the clamped SwiGLU (a limit low enough to clamp, alpha off its default), top-k softmax
routing, alternating local (window 7) and global layers and YaRN (truncate false). A tiny random model built
from its config (no hub), every weight perturbed: fp32 logits at T = 48 (the window 7 times over) whole and
in packed documents, greedy tokens 64 past the window through our KV cache, export bit for bit; an MXFP4
checkpoint (hand-made) imports dequantized with a note; what gpt-oss cannot hold is one line."""

import json

import pytest
import torch
import yaml
from conftest import hf_common, hf_export_same_files, hf_import, hf_perturbed, one_line, run_main
from conftest import main_code as cli
from safetensors.torch import load_file, save_file

from gptkit import accounting as acc
from gptkit import hf
from gptkit.conf_tree import conf_dir
from gptkit.errors import GptkitError
from gptkit.hf.moe import Mixtral
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig
from gptkit.model.layers import RotaryEmbedding

transformers = pytest.importorskip("transformers")

# a window of 7, YaRN from an original context of 16, room for a prompt of 8 and 64 new tokens
V, T, W, POSITIONS = 64, 48, 7, 96
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
    "rope_theta": 1e4,
}
# the rows of each expert tensor MXFP4 packs: 32 values per block
D_MODEL, D_EXPERT = 64, 32


def hf_model(**change):
    """A tiny GptOssForCausalLM: two layers (local, global), 4 experts top-2, every weight random; its clamp
    at 1.0 (most gates and ups clamp) and alpha 1.5 (not the default): a mapping that ignored either moves
    the logits."""
    cfg = transformers.GptOssConfig(
        **hf_common(V, POSITIONS, hidden_size=D_MODEL, intermediate_size=D_EXPERT, head_dim=16),
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=W,
        rope_parameters=YARN,
        swiglu_limit=1.0,
        swiglu_alpha=1.5,
        tie_word_embeddings=False,
        **change,
    )
    return hf_perturbed(lambda: transformers.GptOssForCausalLM(cfg))


WANT = dict(
    attn_sinks=True,
    bias=True,
    qkv_bias=True,
    layer_types=["local", "global"],
    sliding_window=W,
    rope_theta=1e4,
    rope_scaling=dict(
        type="yarn",
        factor=4.0,
        original_max_seq_len=16,
        beta_fast=32.0,
        beta_slow=1.0,
        attention_factor=None,
        mscale=None,
        mscale_all_dim=None,
        truncate=False,
    ),
)
WANT_MOE = dict(
    n_experts=4,
    top_k=2,
    d_expert=D_EXPERT,
    router_bias=True,
    expert_biases=True,
    activation="clamped_swiglu",
    swiglu_limit=1.0,
    swiglu_alpha=1.5,
    norm_topk_prob=True,
)


@pytest.fixture(scope="module")
def theirs():
    return hf_model()


def with_attention(model, attention: str) -> GPT:
    cfg = ModelConfig.from_dict({**model.cfg.to_dict(), "attention": attention})
    return GPT.from_state(cfg, model.state_dict()).eval()


def test_import_has_transformers_logits_whole_and_packed_and_export_gives_back_the_same_files(
    tmp_path, theirs
):
    """Import -> transformers' eager logits (GptOss has no sdpa in transformers) within 1e-5 in our eager and
    sdpa, on T = 48 whole and packed into documents (positions restarting: each document's logits those of
    transformers run on it alone; its GptOssModel does not mask packed position_ids); export -> the same
    safetensors bit for bit and config.json's keys, which transformers loads."""
    model_cfg, model = hf_import(tmp_path, theirs, WANT)
    assert all(getattr(model_cfg.moe, k) == v for k, v in WANT_MOE.items())
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))  # [B, T]
    lengths = [[20, 3, 25], [T]]
    doc_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])  # [B, T]
    packed_cfg = {**model_cfg.to_dict(), "position_reset": True}
    with torch.no_grad():
        ref = theirs(idx).logits
        alone = []  # (row, start, each document's logits alone)
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                alone.append((b, start, theirs(idx[b : b + 1, start : start + n]).logits[0]))
                start += n
        for attention in ("eager", "sdpa"):
            ours = with_attention(model, attention)
            assert (ours(idx).logits - ref).abs().max().item() <= 1e-5, attention
            packed = GPT.from_state(
                ModelConfig.from_dict(packed_cfg | {"attention": attention}), model.state_dict()
            ).eval()
            got = packed(idx, doc_ids=doc_ids).logits  # [B, T, V]
            for b, start, want in alone:
                assert (got[b, start : start + len(want)] - want).abs().max().item() <= 1e-5, (attention, b)
    hf_export_same_files(tmp_path, "GptOssForCausalLM", idx, ref)
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    for key in (
        "model_type",
        "attention_bias",
        "layer_types",
        "sliding_window",
        "rope_parameters",
        "num_local_experts",
        "num_experts_per_tok",
        "intermediate_size",
        "swiglu_limit",
        "swiglu_alpha",
        "head_dim",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert again[key] == original[key], key
    assert "quantization_config" not in again


def test_greedy_tokens_past_the_window_equal_transformers_generate(theirs):
    """64 greedy tokens after a prompt of 8 (the window of 7 passed 9 times over, YaRN-scaled positions): our
    KV cache's tokens are transformers' generate's, and recomputing without a cache and the static cache (the
    fixed-shape decode) give the same."""
    model = hf.from_transformers(theirs)
    prompt = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])  # [1, 8]
        want = theirs.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            pad_token_id=0,
        )[0, 8:].tolist()
    opts = SampleOptions(max_new_tokens=64, temperature=0.0, decode="eager")
    got = generate(model, prompt, opts).tokens[0]
    assert len(want) == 64 and len(set(want)) > 3 and got == want
    assert generate(model, prompt, opts, use_cache=False).tokens[0] == want
    static = SampleOptions(max_new_tokens=64, temperature=0.0, decode="static")
    assert generate(with_attention(model, "sdpa"), prompt, static).tokens[0] == want


# ---- MXFP4 -----------------------------------------------------------------------------------------
def packed(n_experts: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [E, rows, cols / 32, 16] and scales [E, rows, cols / 32] near 2^0."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n_experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(122, 126, (n_experts, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def mxfp4_folders(tmp_path, theirs):
    """tmp_path/plain: `theirs` with every expert weight set to random MXFP4 values (dequantized by
    transformers' reader into its bf16 biases' dtype); tmp_path/mxfp4: the same model as the released
    checkpoints hold it (_blocks and _scales, quantization_config mxfp4)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = theirs.to(torch.bfloat16)
    quantized = {}
    with torch.no_grad():
        for i, layer in enumerate(theirs.model.layers):
            e = layer.mlp.experts
            for j, (name, rows, cols) in enumerate(
                (("gate_up_proj", 2 * D_EXPERT, D_MODEL), ("down_proj", D_MODEL, D_EXPERT))
            ):
                blocks, scales = packed(4, rows, cols, seed=10 * i + j)
                getattr(e, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
                quantized[f"model.layers.{i}.mlp.experts.{name}"] = (blocks, scales)
    theirs.save_pretrained(tmp_path / "plain")
    theirs.save_pretrained(tmp_path / "mxfp4")
    f = tmp_path / "mxfp4" / "model.safetensors"
    state = {k: v for k, v in load_file(f).items() if k not in quantized}
    for k, (blocks, scales) in quantized.items():
        state[k + "_blocks"], state[k + "_scales"] = blocks, scales
    save_file(state, f, metadata={"format": "pt"})
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    return state


def test_an_mxfp4_checkpoint_imports_dequantized_with_a_note_and_exports_plain(tmp_path, capsys):
    state = mxfp4_folders(tmp_path, hf_model())
    assert state["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    assert cli("import", f"hf={tmp_path / 'mxfp4'}", f"out={tmp_path / 'run'}") == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "MXFP4" in line]
    assert (
        len(notes) == 1 and notes[0].startswith("note: ") and "4 tensors dequantized to bfloat16" in notes[0]
    )
    provenance = json.loads((tmp_path / "run" / "imported_from.json").read_text())
    assert provenance["notes"] == [notes[0].removeprefix("note: ")]
    assert cli("import", f"hf={tmp_path / 'plain'}", f"out={tmp_path / 'plain-run'}") == 0
    from gptkit.runs import load_model

    quantized, plain = load_model(tmp_path / "run")[-1], load_model(tmp_path / "plain-run")[-1]
    assert all(torch.equal(quantized.state_dict()[k], v) for k, v in plain.state_dict().items())
    # export: the plain tensors transformers' reader produces, and no quantization_config
    assert cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'again'}", "dtype=bfloat16") == 0
    again = load_file(tmp_path / "again" / "model.safetensors")
    original = load_file(tmp_path / "plain" / "model.safetensors")
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[k], v) for k, v in original.items())
    assert "quantization_config" not in json.loads((tmp_path / "again" / "config.json").read_text())


@pytest.mark.parametrize(
    "change, named",
    [
        # a block short: the header's shape against config.json, before anything is read
        (
            lambda s: (
                s
                | {"model.layers.1.mlp.experts.down_proj_blocks": torch.zeros(4, 64, 1, 8, dtype=torch.uint8)}
            ),
            "MXFP4 tensor model.layers.1.mlp.experts.down_proj_blocks has shape (4, 64, 1, 8), the "
            "config needs (4, 64, 1, 16)",
        ),
        (
            lambda s: {k: v for k, v in s.items() if k != "model.layers.0.mlp.experts.gate_up_proj_scales"},
            "model.layers.0.mlp.experts.gate_up_proj_blocks without its "
            "model.layers.0.mlp.experts.gate_up_proj_scales",
        ),
    ],
)
def test_a_wrong_mxfp4_tensor_is_one_line(tmp_path, capsys, change, named):
    state = mxfp4_folders(tmp_path, hf_model())
    save_file(change(state), tmp_path / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_main(capsys, "import", f"hf={tmp_path / 'mxfp4'}", f"out={tmp_path / 'run'}")
    assert code == 2 and one_line(err) and named in err, err
    assert not (tmp_path / "run").exists()


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, named",
    [
        (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config.quant_method"),
        (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types"),
        (dict(swiglu_limit=-1.0), "swiglu_limit"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_configs_gpt_oss_cannot_hold_are_refused_by_name(theirs, change, named):
    d = theirs.config.to_dict() | change
    with pytest.raises(GptkitError, match=named):
        hf.model_config_from_hf(d)


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(attn_sinks=False), "model.attn_sinks=False"),
        (dict(qkv_bias=False), "model.qkv_bias=False"),
        (dict(moe=dict(expert_biases=False)), "model.moe.expert_biases=False"),
        (dict(moe=dict(activation="swiglu")), "model.moe.activation=swiglu"),
        (dict(moe=dict(every=2)), "model.moe.every=2"),
    ],
)
def test_gpt_oss_configs_without_their_blocks_are_refused_on_export_and_the_others_refuse_them(
    theirs, change, named
):
    cfg = hf.from_transformers(theirs).cfg.to_dict()
    cfg = ModelConfig.from_dict(cfg | change | {"moe": cfg["moe"] | change.get("moe", {})})
    with pytest.raises(GptkitError, match=named):
        hf.hf_config(cfg)
    # Mixtral's family (qk_norm null, a mixture) refuses gpt-oss's blocks
    with pytest.raises(GptkitError, match="refusing"):
        Mixtral().check(hf.from_transformers(theirs).cfg)


# ---- presets -------------------------------------------------------------------------------------------
def preset(name: str) -> ModelConfig:
    return ModelConfig.from_dict(yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text()))


# total, active: transformers' GptOssForCausalLM of the released config.json on the meta device (OpenAI's
# 3.6B and 5.1B active leave out the unembedding, 201,088 x 2,880 = 579,133,440)
COUNTS = {
    "gpt-oss-20b": (20_914_757_184, 4_187_440_704),
    "gpt-oss-120b": (116_829_156_672, 5_711_982_912),
    "gpt-oss-tiny": (10_573_488, 8_939_952),
}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_presets_count_total_and_active_as_transformers_builds_them(name):
    cfg = preset(name)
    c = acc.count_params(cfg)
    assert (c.total, c.active) == COUNTS[name]
    d = hf.hf_config(cfg)
    config = transformers.GptOssConfig(
        **{k: v for k, v in d.items() if k not in ("architectures", "dtype", "model_type")}
    )
    with torch.device("meta"):
        theirs = transformers.GptOssForCausalLM(config)
        assert GPT(cfg).num_parameters() == c.total
    total = sum(p.numel() for p in theirs.parameters())
    # a token uses top_k of the n_experts experts of every layer (their biases included)
    experts = sum(p.numel() for n, p in theirs.named_parameters() if ".experts." in n)
    m = cfg.moe
    assert (total, total - experts * (m.n_experts - m.top_k) // m.n_experts) == COUNTS[name]
    assert hf.model_config_from_hf(config.to_dict(), name=cfg.name) == cfg


def released(layers: int, experts: int) -> dict:
    """openai/gpt-oss-20b's (24, 32) and -120b's (36, 128) config.json, as released (transformers 4.55's keys:
    rope_scaling and rope_theta, the MXFP4 quantization_config, OpenAI's own extra keys)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "num_local_experts": experts,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 201088,
    }


@pytest.mark.parametrize("name, layers, experts", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_presets_are_the_released_configs_and_their_yarn_is_transformers(name, layers, experts):
    """The released config.json imports as the preset; its RoPE tables (YaRN factor 32 over 4096, beta 32/1,
    truncate false, attention factor 1 + 0.1 ln 32 on cos and sin) equal transformers' GptOssRotaryEmbedding
    at positions inside, at and far past the original context."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    cfg = preset(name)
    assert hf.model_config_from_hf(released(layers, experts), name=name) == cfg
    d = hf.hf_config(cfg)
    config = transformers.GptOssConfig(
        **{k: v for k, v in d.items() if k not in ("architectures", "dtype", "model_type")}
    )
    theirs = GptOssRotaryEmbedding(config)
    ours = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, scaling=cfg.rope_scaling)
    positions = torch.tensor([[0, 1, 127, 4095, 4096, 65536, 131071]])
    cos, sin = theirs(torch.zeros(1), positions)  # [1, 7, head_dim / 2]
    half = cfg.head_dim // 2
    assert torch.equal(ours.cos[positions[0], :half], cos[0]) and torch.equal(
        ours.sin[positions[0], :half], sin[0]
    )
    assert theirs.attention_scaling > 1.3
