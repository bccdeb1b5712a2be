"""Sliding windows and today's dense families against transformers: Mistral v0.1 (a window in every layer) and
v0.3, Gemma 2 (alternating local/global, soft-capping, sandwich norms), Gemma 3's text model (5 local : 1
global pattern, QK-norm, a RoPE per layer type, linear scaling on the global layers), OLMo 3 (3 local : 1
global, OLMo-2's layer, YaRN on the global layers only) and Qwen2 with YaRN and max_window_layers. Tiny
random models built from their configs (no hub), every weight perturbed; fp32 logits at a length past the
window and past the original context, greedy tokens, export bit for bit."""

import pytest
import torch
from conftest import hf_common, hf_export_same_files, hf_import, hf_perturbed

from gptkit import hf
from gptkit.errors import GptkitError
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig

transformers = pytest.importorskip("transformers")

# a window of 7 and an original context of 10 in sequences of 40
V, T, W = 64, 40, 7


def hf_model(kind: str):
    """A tiny transformers model of each family, every weight random (norms included)."""
    common = hf_common(V, T, num_hidden_layers=3)
    if kind == "mistral-v0.1":
        cfg = transformers.MistralConfig(**common, sliding_window=W, tie_word_embeddings=False)
    elif kind == "mistral-v0.3":
        cfg = transformers.MistralConfig(**common, sliding_window=None, head_dim=16, rope_theta=1e6)
    elif kind == "gemma2":
        cfg = transformers.Gemma2Config(
            **common,
            head_dim=16,
            sliding_window=W,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        )
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **(common | {"num_hidden_layers": 4}),
            head_dim=16,
            sliding_window=W,
            query_pre_attn_scalar=24,
            sliding_window_pattern=2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        )
    elif kind == "olmo3":
        # three local layers and a global one; YaRN on the global layers only, the local ones plain
        cfg = transformers.Olmo3Config(
            **(common | {"num_hidden_layers": 4}),
            sliding_window=W,
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 10,
                    "rope_theta": 1e4,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    else:
        cfg = transformers.Qwen2Config(
            **common,
            use_sliding_window=True,
            sliding_window=W,
            max_window_layers=1,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 10,
                "rope_theta": 1e4,
            },
        )
    return hf_perturbed(lambda: transformers.AutoModelForCausalLM.from_config(cfg))


KINDS = ["mistral-v0.1", "mistral-v0.3", "gemma2", "gemma3", "olmo3", "qwen2-yarn"]
# what each family is in gptkit's fields
WANT = {
    "mistral-v0.1": dict(sliding_window=W, layer_types=None, local_layers=[0, 1, 2]),
    "mistral-v0.3": dict(sliding_window=None, rope_theta=1e6, head_dim=16),
    "gemma2": dict(
        mlp="geglu",
        norm="rmsnorm_unit_offset",
        norm_placement="sandwich",
        scale_embeddings=True,
        layer_types=["local", "global", "local"],
        query_pre_attn_scalar=24,
        attn_softcap=5.0,
        logit_softcap=3.0,
    ),
    "gemma3": dict(
        qk_norm="head",
        layer_types=["local", "global", "local", "global"],
        rope_scaling={"type": "linear", "factor": 2.0},
        rope_local_theta=100.0,
        attn_softcap=None,
    ),
    "olmo3": dict(
        qk_norm="full",
        norm_placement="post",
        layer_types=["local", "local", "local", "global"],
        rope_local_theta=1e4,
        rope_scaling=dict(
            type="yarn",
            factor=4.0,
            original_max_seq_len=10,
            beta_fast=32.0,
            beta_slow=1.0,
            attention_factor=None,
            mscale=None,
            mscale_all_dim=None,
            truncate=True,
        ),
    ),
    "qwen2-yarn": dict(qkv_bias=True, layer_types=["global", "local", "local"]),
}


@pytest.mark.parametrize("kind", KINDS)
def test_windowed_families_match_transformers_and_export_the_same_files(tmp_path, kind):
    """Import -> the logits of transformers on the same backend (<= 1e-5) at T = 40 (window 7, YaRN's original
    context 10), the greedy tokens of transformers' generate (our decoder: the rolling cache), and export ->
    the same safetensors bit for bit, loaded by AutoModelForCausalLM with the same logits."""
    theirs = hf_model(kind)
    model_cfg, model = hf_import(tmp_path, theirs, WANT[kind])
    idx = torch.randint(0, V, (2, T))  # [B, T]
    # transformers runs Gemma 2 (soft-capping) in eager only
    backends = ("eager",) if kind == "gemma2" else ("eager", "sdpa")
    with torch.no_grad():
        for attention in backends:
            theirs.set_attn_implementation(attention)
            ref = theirs(idx).logits
            ours = GPT.from_state(
                ModelConfig.from_dict({**model_cfg.to_dict(), "attention": attention}), model.state_dict()
            )
            assert (ours(idx).logits - ref).abs().max().item() <= 1e-5, attention
        prompt = idx[0, :12]
        want = theirs.generate(prompt[None], max_new_tokens=20, do_sample=False)[0, 12:].tolist()
    opts = SampleOptions(max_new_tokens=20, temperature=0.0, decode="eager")
    assert generate(model, prompt.tolist(), opts).tokens[0] == want
    # v0.3 has no window: transformers' Llama is the same model
    architecture = "LlamaForCausalLM" if kind == "mistral-v0.3" else type(theirs).__name__
    hf_export_same_files(tmp_path, architecture, idx, ref, attention=backends[-1])


@pytest.mark.parametrize("rope", ["linear", "dynamic", "yarn-mscale"])
def test_rope_scalings_match_transformers(rope):
    """Linear, dynamic NTK (past max_position_embeddings: transformers scales by the forward's length) and
    YaRN with DeepSeek's mscale pair and truncate=false, on a Llama; kept by export's config."""
    params = {
        "linear": {"rope_type": "linear", "factor": 3.0},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0},
        "yarn-mscale": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
            "truncate": False,
        },
    }[rope]
    mpe = 16 if rope == "dynamic" else T
    # (hf_common's rms_norm_eps and pad_token_id are LlamaConfig's defaults)
    cfg = transformers.LlamaConfig(**hf_common(V, mpe, rope_parameters={"rope_theta": 500.0, **params}))
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(cfg).eval()
    ours = hf.from_transformers(theirs)
    if rope == "dynamic":
        # gptkit's context may exceed the original one: dynamic NTK scales past it
        ours = GPT.from_state(
            ModelConfig.from_dict({**ours.cfg.to_dict(), "max_seq_len": T}), ours.state_dict()
        )
    idx = torch.randint(0, V, (1, T))
    with torch.no_grad():
        assert (ours(idx).logits - theirs(idx).logits).abs().max().item() <= 1e-5
        plain = GPT.from_state(
            ModelConfig.from_dict({**ours.cfg.to_dict(), "rope_scaling": None}), ours.state_dict()
        )
        assert (plain(idx).logits - theirs(idx).logits).abs().max().item() > 1e-3
    assert hf.model_config_from_hf(hf.hf_config(ours.cfg)).rope_scaling == ours.cfg.rope_scaling


def test_fused_loss_and_norm_kernels_take_the_soft_caps_and_unit_offset():
    """model.kernels [norm, loss] on Gemma 2: (1 + w) norms and the soft-capped loss equal the eager model's
    loss and gradients."""
    model = hf.from_transformers(hf_model("gemma2")).train()
    fused = GPT.from_state(
        ModelConfig.from_dict({**model.cfg.to_dict(), "kernels": ["norm", "loss"]}), model.state_dict()
    ).train()
    idx = torch.randint(0, V, (1, 12))
    a, b = model(idx, idx).loss, fused(idx, idx).loss
    assert abs(a.item() - b.item()) <= 1e-5
    a.backward()
    b.backward()
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(hidden_activation="gelu"), "hidden_activation"),
        (
            dict(
                rope_parameters={
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}
                }
            ),
            "sliding_attention",
        ),
    ],
)
def test_unsupported_gemma_configs_are_refused_by_name(change, named):
    d = hf_model("gemma3").config.to_dict()
    if "rope_parameters" in change:
        change = {"rope_parameters": d["rope_parameters"] | change["rope_parameters"]}
    with pytest.raises(GptkitError, match=named):
        hf.model_config_from_hf(d | change)


def test_window_patterns_without_a_transformers_architecture_are_refused_on_export():
    """A Llama with some local layers (Mistral slides every layer; Qwen2 only its last ones) has no faithful
    transformers architecture."""
    base = dict(
        vocab_size=V, n_layers=3, n_heads=4, d_model=32, position="rope", mlp="swiglu", norm="rmsnorm"
    )
    base |= dict(bias=False, sliding_window=4)
    with pytest.raises(GptkitError, match="MistralForCausalLM"):
        hf.hf_config(ModelConfig(**base, layer_types=["local", "global", "local"]))
    with pytest.raises(GptkitError, match="max_window_layers"):
        hf.hf_config(ModelConfig(**base, qkv_bias=True, layer_types=["local", "global", "global"]))
    assert hf.architecture(ModelConfig(**base)) == "mistral"
