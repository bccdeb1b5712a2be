"""Multi-head latent attention (model.attention_kind=mla, gptkit/model/mla.py): the same logits as
transformers' DeepseekV3Attention (its weights loaded by a small mapping here; the family file is a later
task), the latent cache's size at DeepSeek-V3's shape, the backends, the FLOPs, and bad config values.
Decoding through every cache is tests/model/test_attention_kinds.py's (the mla rows)."""

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from gptkit import accounting
from gptkit.errors import ConfigError
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, KVCache, ModelConfig
from gptkit.model.attention_kinds import cache_layout
from gptkit.model.mla import MultiHeadLatentAttention

V, T = 61, 24
SHAPES = dict(kv_lora_rank=12, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=8)
YARN = {"factor": 4.0, "original_max_position_embeddings": 8, "mscale": 0.707, "mscale_all_dim": 1.0}


def hf_model(q_lora_rank, yarn: bool):
    """A tiny DeepSeek-V3, dense layers only (first_k_dense_replace = its layers), every weight perturbed."""
    rope = {"rope_theta": 500.0, "rope_type": "default"}
    if yarn:
        rope = {"rope_theta": 500.0, "rope_type": "yarn", **YARN}
    cfg = transformers.DeepseekV3Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,
        q_lora_rank=q_lora_rank,
        max_position_embeddings=T,
        tie_word_embeddings=False,
        rope_parameters=rope,
        **SHAPES,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def from_hf(theirs, q_lora_rank, yarn: bool, attention="eager") -> GPT:
    """The gptkit model of llama-tiny's kind with attention_kind=mla, holding `theirs`' weights."""
    c = theirs.config
    scaling = None
    if yarn:
        scaling = {"type": "yarn", "factor": YARN["factor"], "original_max_seq_len": 8}
        scaling.update(mscale=YARN["mscale"], mscale_all_dim=YARN["mscale_all_dim"], truncate=True)
    cfg = ModelConfig(
        vocab_size=V,
        max_seq_len=T,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        d_model=c.hidden_size,
        d_ff=c.intermediate_size,
        position="rope",
        rope_theta=500.0,
        rope_scaling=scaling,
        mlp="swiglu",
        norm="rmsnorm",
        norm_eps=c.rms_norm_eps,
        bias=False,
        tie_embeddings=False,
        attention=attention,
        attention_kind="mla",
        # DeepSeek's checkpoints keep the rotated pairs interleaved (transformers' rope_interleave=True)
        mla=dict(q_lora_rank=q_lora_rank, rope_interleave=c.rope_interleave, **SHAPES),
    )
    names = {"model.embed_tokens.": "tok_emb.", "model.norm.": "final_norm.", "lm_head.": "lm_head."}
    per_layer = {
        "self_attn.": "attn.",
        "input_layernorm.": "attn_norm.",
        "post_attention_layernorm.": "mlp_norm.",
    }
    state = {}
    for key, value in theirs.state_dict().items():
        for a, b in names.items():
            if key.startswith(a):
                state[b + key[len(a) :]] = value
        if key.startswith("model.layers."):
            i, rest = key[len("model.layers.") :].split(".", 1)
            for a, b in {**per_layer, "mlp.": "mlp."}.items():
                rest = rest.replace(a, b, 1) if rest.startswith(a) else rest
            state[f"blocks.{i}.{rest}"] = value
    model = GPT(cfg).eval()
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("q_lora_rank, yarn", [(16, True), (None, False)])
def test_logits_and_greedy_tokens_equal_transformers_deepseek_v3(q_lora_rank, yarn):
    """fp32 logits within 1e-5 of DeepseekV3ForCausalLM's (a low-rank query and YaRN with DeepSeek's mscale
    pair, whose mscale_all_dim also scales the scores; q_proj and plain RoPE), and greedy tokens through the
    latent cache equal transformers' generate."""
    theirs = hf_model(q_lora_rank, yarn)
    ours = from_hf(theirs, q_lora_rank, yarn)
    assert isinstance(ours.blocks[0].attn, MultiHeadLatentAttention)
    assert hasattr(ours.blocks[0].attn, "q_proj") == (q_lora_rank is None)
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(idx).logits
        assert (ours(idx).logits - want).abs().max().item() <= 1e-5
        # the weight-absorbed path (a prefill, then one token at a time) gives the same logits
        cache = KVCache(ours.cfg, batch_size=2)
        got = [ours(idx[:, :5], cache=cache).logits]
        got += [ours(idx[:, t : t + 1], cache=cache).logits for t in range(5, T)]
        assert (torch.cat(got, dim=1) - want).abs().max().item() <= 1e-5
        prompt = idx[:1, :4]
        # every new token (transformers' config has an end token: not one here)
        theirs.generation_config.eos_token_id = None
        hf_tokens = theirs.generate(prompt, max_new_tokens=T - 4, do_sample=False)[0, 4:].tolist()
    opts = SampleOptions(max_new_tokens=T - 4, temperature=0)
    assert generate(ours, prompt[0].tolist(), opts).tokens[0] == hf_tokens
    # count-params: transformers' attention parameters
    a = sum(p.numel() for n, p in theirs.named_parameters() if ".self_attn." in n and "layernorm" not in n)
    assert accounting.count_params(ours.cfg).attention == a


def deepseek_v3_attention(n_layers=1, **over) -> ModelConfig:
    """DeepSeek-V3's attention shape (its config.json), dense layers."""
    mla = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    cfg = dict(vocab_size=129280, max_seq_len=4096, n_layers=n_layers, n_heads=128, d_model=7168)
    cfg.update(d_ff=18432, position="rope", mlp="swiglu", norm="rmsnorm", bias=False, tie_embeddings=False)
    return ModelConfig(**cfg, attention_kind="mla", mla=mla, **over)


def test_the_latent_cache_keeps_576_numbers_per_token_at_deepseek_v3s_shape():
    """kv_lora_rank 512 + the rotated key 64 per token per layer, against 2 * 128 heads * 128 for multi-head
    attention of the same heads; count-params' KV figures read it. count-params equals transformers'."""
    cfg = deepseek_v3_attention(n_layers=2)
    lay = cache_layout(cfg, 0)
    assert (lay.k, lay.v, lay.per_position) == ((1, 576), (1, 0), 576)
    assert accounting.kv_cache_bytes_per_token(cfg, "bf16") == 2 * 576 * 2
    mha = ModelConfig(**{**cfg.to_dict(), "attention_kind": "mha", "mla": None, "head_dim": 128})
    assert cache_layout(mha, 0).per_position == 32768
    assert accounting.kv_cache_bytes(cfg, 4096, "bf16") == 4096 * 2 * 576 * 2
    # the transformers model's attention parameters, on the meta device
    hf = transformers.DeepseekV3Config(
        vocab_size=129280, num_hidden_layers=1, first_k_dense_replace=1, tie_word_embeddings=False
    )
    with torch.device("meta"):
        theirs = transformers.DeepseekV3ForCausalLM(hf)
    one = deepseek_v3_attention()
    assert accounting.count_params(one).total == sum(p.numel() for p in theirs.parameters())


def test_count_params_says_what_mla_caches_and_counts_its_widths_in_the_activations(capsys):
    """The header names the latent and the rotated key a token caches (it said 4 kv heads, = the heads); the
    activation estimate counts MLA's attention by its widths (mla_attention_units), not as d_model-wide MHA.
    By hand, mla-tiny (d 128, 4 heads of qk 32 + 16 and v 32, q_lora_rank 96, kv_lora_rank 64, rope 16):
    3 + 2 * (4 * (2 * 48 + 2 * 32) + 2 * 96 + 2 * 64 + 16) / 128 = 18.25 units for the attention's 11, so
    34 - 11 + 18.25 = 41.25 a layer; bf16, 128 tokens: 4 layers * 41.25 * 128 * 128 bytes, plus the
    embeddings and final norm (3 * 128 * 128 * 2) and the batch (2 * 128 * 8). Measured (saved tensors,
    fp32, CPU): a layer of mla-tiny keeps 7.7 units more than its MHA twin, the softmax's T x T aside (7.25
    here)."""
    import yaml
    from conftest import run_main

    from gptkit.conf_tree import conf_dir

    code, out, err = run_main(capsys, "count-params", "model=mla-tiny")
    header = " ".join(out.split())
    assert code in (0, None), err
    assert "4 heads; MLA caches a 64-wide latent and a 16-wide rotated key per token" in header
    assert "kv heads" not in header
    cfg = ModelConfig.from_dict(yaml.safe_load((conf_dir() / "model" / "mla-tiny.yaml").read_text()))
    assert accounting.mla_attention_units(cfg) == 18.25
    want = 4 * 41.25 * 128 * 128 + 3 * 128 * 128 * 2 + 2 * 128 * 8
    assert accounting.training_memory(cfg, "bf16-mixed")["activations"] == want == 2_803_712
    # multi-head attention of d_model: Korthikanti's 34 a layer, as before
    mha = ModelConfig(**{**cfg.to_dict(), "attention_kind": "mha", "mla": None, "n_kv_heads": 4})
    assert accounting.training_memory(mha, "bf16-mixed")["activations"] == 4 * 34 * 128 * 128 + 100_352


def test_decoding_without_absorption_caches_each_heads_key_and_value_and_gives_the_same_logits():
    """model.mla.absorb=false (the uncompressed path, transformers' cache layout): H * (nope + rope + v)
    numbers per position instead of the latent's kv_lora_rank + rope, the same logits as the absorbed
    decode and the full forward, and the same greedy tokens."""
    cfg = dict(vocab_size=V, max_seq_len=T, n_layers=2, n_heads=4, d_model=32, position="rope")
    cfg.update(attention_kind="mla", mlp="swiglu", norm="rmsnorm", init_std=0.3)
    torch.manual_seed(0)
    absorbed = GPT(ModelConfig(**cfg, mla={**SHAPES, "q_lora_rank": 8})).eval()
    plain = GPT(ModelConfig(**cfg, mla={**SHAPES, "q_lora_rank": 8, "absorb": False})).eval()
    plain.load_state_dict(absorbed.state_dict())
    assert cache_layout(absorbed.cfg, 0).per_position == 12 + 4
    assert cache_layout(plain.cfg, 0).per_position == 4 * (12 + 4) + 4 * 8
    idx = torch.randint(0, V, (2, T))
    with torch.no_grad():
        full = absorbed(idx).logits
        for model in (absorbed, plain):
            cache = KVCache(model.cfg, batch_size=2)
            got = [model(idx[:, :5], cache=cache).logits]
            got += [model(idx[:, t : t + 1], cache=cache).logits for t in range(5, T)]
            torch.testing.assert_close(torch.cat(got, dim=1), full, atol=1e-5, rtol=0)
    opts = SampleOptions(max_new_tokens=12, temperature=0.0)
    prompt = idx[0, :4].tolist()
    assert generate(plain, prompt, opts).tokens == generate(absorbed, prompt, opts).tokens


def test_the_flops_are_torchs_count_of_the_training_path():
    """flops_per_token counts MLA's real matmuls: q_a/q_b (or q_proj), kv_a_proj_with_mqa, the whole kv_b_proj
    (every token's latent expanded to its keys and values), o_proj, and attention with queries and keys of
    nope + rope and values of v_head_dim per head; equal to torch's flop counter on the training path."""
    for q_lora_rank in (16, None):
        cfg = ModelConfig(
            vocab_size=V, max_seq_len=T, n_layers=2, n_heads=4, d_model=32, position="rope", mlp="swiglu",
            norm="rmsnorm", bias=False, tie_embeddings=False, attention_kind="mla",
            mla=dict(q_lora_rank=q_lora_rank, **SHAPES),
        )  # fmt: skip
        model = GPT(cfg).eval()
        idx = torch.randint(0, V, (2, T))
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(idx)
        assert counter.get_total_flops() == accounting.flops_per_token(cfg, T).forward_dense * 2 * T


def test_the_triton_backend_equals_eager_forward_and_backward():
    """model.attention=triton (the interpreter here): queries and keys of nope + rope = 16, values of 8
    (padded to 16 in the kernel), packed documents; the logits and every gradient equal eager's in fp32."""
    theirs = hf_model(16, False)
    eager, triton = (from_hf(theirs, 16, False, attention=a) for a in ("eager", "triton"))
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))
    doc_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    outs = []
    for model in (eager, triton):
        model.train()
        out = model(idx, idx, doc_ids=doc_ids)
        out.loss.backward()
        outs.append((out.logits, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=0)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "over, message",
    [
        ({"mla": None}, r"model.attention_kind=mla needs model.mla"),
        ({"mla": {**SHAPES, "qk_rope_head_dim": 5}}, r"qk_rope_head_dim=5 must be even"),
        ({"mla": {**SHAPES, "qk_rope_head_dim": 0}}, r"qk_rope_head_dim=0 must be an integer >= 2"),
        ({"mla": {**SHAPES, "kv_lora_rank": None}}, r"kv_lora_rank=None must be an integer >= 1"),
        ({"mla": {**SHAPES, "q_lora_rank": 0}}, r"q_lora_rank=0 must be a positive integer"),
        ({"mla": {**SHAPES, "rank": 4}}, r"unknown model.mla field\(s\) rank"),
        ({"mla": 512}, r"model.mla=512 must be a mapping"),
        ({"mla": {**SHAPES, "absorb": "no"}}, r"model.mla.absorb='no' must be true or false"),
        ({"mla": SHAPES, "qk_norm": "head"}, r"model.qk_norm does not apply to model.attention_kind=mla"),
        ({"mla": SHAPES, "rotary_dim": 2}, r"model.rotary_dim does not apply"),
        ({"attention_kind": "mha", "mla": SHAPES}, r"model.mla is set but model.attention_kind=mha"),
        ({"mla": SHAPES, "n_kv_heads": 2}, r"model.n_kv_heads=2 does not apply to model.attention_kind=mla"),
    ],
)
def test_bad_values_are_one_line(over, message):
    cfg = dict(n_layers=1, n_heads=4, d_model=32, position="rope", attention_kind="mla")
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig(**{**cfg, **over})
    assert "\n" not in str(err.value)
