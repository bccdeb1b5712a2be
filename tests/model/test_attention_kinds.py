"""The attention seam (gptkit/model/attention_kinds.py): one table of kinds, one cache layout per layer read
by every cache and by the accounting. Two stub kinds prove the seam without touching shared code: one
caching k and v of different widths (as multi-head latent attention does), one keeping a recurrent state
instead (as linear attention does), and a model mixing the two; each decodes through every path (the
growing KV cache, the static cache, serve's slot cache, rollouts) exactly as it recomputes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptkit import accounting
from gptkit.errors import ConfigError
from gptkit.inference.batcher import SamplingParams, generate_many
from gptkit.inference.generate import generate
from gptkit.inference.rollouts import RolloutOptions, sample_groups, sample_groups_batched
from gptkit.inference.sampling import SampleOptions
from gptkit.inference.slot_cache import SlotCache
from gptkit.model import GPT, KVCache, ModelConfig, StaticKVCache
from gptkit.model.attention import get_attention
from gptkit.model.attention_kinds import ATTENTION_KINDS, AttentionKind, CacheLayout, cache_layout
from gptkit.model.mha import MultiHeadAttention


class WideValues(nn.Module):
    """Attention whose values are twice as wide as its keys: K [n_kv_heads, head_dim], V [n_kv_heads,
    2 * head_dim] per cached position."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.layer, self.h, self.hkv, self.d = layer, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, self.h * self.d, bias=False)
        self.k = nn.Linear(cfg.d_model, self.hkv * self.d, bias=False)
        self.v = nn.Linear(cfg.d_model, self.hkv * 2 * self.d, bias=False)
        self.o = nn.Linear(self.h * 2 * self.d, cfg.d_model, bias=False)
        self.attend, self.window = get_attention(cfg.attention), cfg.window(layer)

    def forward(self, x, *, rope=None, cache=None, positions=0, docs=None, return_probs=False):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.d).transpose(1, 2)  # [B, h, T, d]
        k = self.k(x).view(B, T, self.hkv, self.d).transpose(1, 2)  # [B, hkv, T, d]
        v = self.v(x).view(B, T, self.hkv, 2 * self.d).transpose(1, 2)  # [B, hkv, T, 2d]
        if rope is not None:
            q, k = rope(q, k, positions)
        mask = None
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
            mask = cache.mask_for(self.layer)
        y, _ = self.attend(q, k, v, causal=True, mask=mask, docs=docs, window=self.window)  # [B, h, T, 2d]
        return self.o(y.transpose(1, 2).reshape(B, T, -1)), None


class RunningState(nn.Module):
    """Linear attention: state S [h, d, d] += k_t v_t^T each position, y_t = q_t S (a recurrent state, no
    K/V cache). Decoding and recomputing run the same loop."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.layer, self.h, self.d = layer, cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * self.h * self.d, bias=False)
        self.o = nn.Linear(self.h * self.d, cfg.d_model, bias=False)

    def forward(self, x, *, rope=None, cache=None, positions=0, docs=None, return_probs=False):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d).unbind(2)  # [B, T, h, d] each
        k = F.normalize(k, dim=-1) / self.d
        S = x.new_zeros(B, self.h, self.d, self.d) if cache is None else cache.state(self.layer, x).clone()
        ys = []
        for t in range(T):
            S = S + k[:, t, :, :, None] * v[:, t, :, None, :]  # [B, h, d, d]
            ys.append(torch.einsum("bhd,bhde->bhe", q[:, t], S))  # [B, h, d]
        if cache is not None:
            cache.state(self.layer, x).copy_(S)
        return self.o(torch.stack(ys, dim=1).reshape(B, T, -1)), None


def hybrid(cfg, layer):
    """Even layers keep a state, odd layers K/V of different widths."""
    return RunningState(cfg, layer) if layer % 2 == 0 else WideValues(cfg, layer)


def wide_layout(cfg, layer):
    return CacheLayout((cfg.n_kv_heads, cfg.head_dim), (cfg.n_kv_heads, 2 * cfg.head_dim), cfg.window(layer))


def state_layout(cfg, layer):
    return CacheLayout(None, None, state=(cfg.n_heads, cfg.head_dim, cfg.head_dim))


STUBS = {
    "wide_values": AttentionKind(f"{__name__}:WideValues", wide_layout),
    "running_state": AttentionKind(f"{__name__}:RunningState", state_layout),
    "hybrid": AttentionKind(
        f"{__name__}:hybrid", lambda cfg, i: (state_layout if i % 2 == 0 else wide_layout)(cfg, i)
    ),
}


@pytest.fixture
def stub_kinds(monkeypatch):
    for name, kind in STUBS.items():
        monkeypatch.setitem(ATTENTION_KINDS, name, kind)


# a kind's own fields (its tiny shapes)
MLA = {"q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}
# Gated DeltaNet: grouped value heads, chunks of 4 (a prefill of 7 crosses one)
GDN = {"n_key_heads": 2, "n_value_heads": 4, "key_head_dim": 8, "value_head_dim": 6, "chunk_size": 4}
KIND_FIELDS = {
    "mla": {"mla": MLA, "n_kv_heads": None},
    # a hybrid: a linear layer, then a full (multi-head attention) one
    "gdn": {"gdn": GDN, "attention_kind": "mha", "layer_types": ["linear", "global"]},
}


def tiny(kind: str, max_seq_len: int = 32, **over) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=61, max_seq_len=max_seq_len, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32)
    cfg.update(position="rope", mlp="swiglu", norm="rmsnorm", bias=False, init_std=0.3, tie_embeddings=False)
    cfg.update({"attention_kind": kind, **KIND_FIELDS.get(kind, {}), **over})
    return GPT(ModelConfig(**cfg)).eval()


PROMPT = [3, 14, 15, 9, 2, 6]


def test_the_default_kind_is_multi_head_and_its_layout_sizes_every_cache():
    model = tiny("mha", sliding_window=8, layer_types=["local", "global"])
    cfg = model.cfg
    assert all(isinstance(b.attn, MultiHeadAttention) for b in model.blocks)
    assert cache_layout(cfg, 0) == CacheLayout((2, 8), (2, 8), 8)
    assert cache_layout(cfg, 1) == CacheLayout((2, 8), (2, 8), None)
    cache = KVCache(cfg, batch_size=3, max_len=20)
    assert [t.shape for t in cache.k] == [(3, 2, 8, 8), (3, 2, 20, 8)]
    slots = SlotCache(cfg, slots=3, max_len=20)
    assert [t.shape for t in slots.v] == [(3, 2, 20, 8)] * 2
    # the accounting's figures are the caches' bytes (fp32: 4 bytes)
    assert accounting.kv_cache_bytes(cfg, 20, "fp32") == cache.nbytes // 3
    assert accounting.kv_cache_bytes_per_token(cfg, "fp32") * 20 == slots.nbytes // 3


def test_an_unknown_kind_is_one_line_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"model.attention_kind='linear' is not one of mha, mla, gdn"):
        ModelConfig(attention_kind="linear")


def test_layouts_size_the_caches_and_the_accounting(stub_kinds):
    cfg = tiny("hybrid").cfg
    assert cache_layout(cfg, 0) == CacheLayout(None, None, None, (4, 8, 8))
    assert cache_layout(cfg, 1) == CacheLayout((2, 8), (2, 16), None)
    cache = KVCache(cfg, batch_size=2, max_len=10)
    assert cache.k[0] is None and cache.states[0].shape == (2, 4, 8, 8)
    assert cache.k[1].shape == (2, 2, 10, 8) and cache.v[1].shape == (2, 2, 10, 16)
    slots = SlotCache(cfg, slots=2, max_len=10)
    assert slots.states[0].shape == (2, 4, 8, 8) and slots.v[1].shape == (2, 2, 10, 16)
    # fp32: 4 bytes per element; the state does not grow with the context
    assert accounting.kv_cache_bytes_per_token(cfg, "fp32") == (2 * 8 + 2 * 16) * 4
    assert accounting.kv_cache_bytes(cfg, 10, "fp32") == cache.nbytes // 2 == slots.nbytes // 2
    assert accounting.kv_cache_bytes(cfg, 0, "fp32") == 4 * 8 * 8 * 4


@pytest.mark.parametrize(
    "kind, over",
    [
        ("wide_values", {}),
        ("running_state", {}),
        ("hybrid", {}),
        # multi-head attention with a NoPE layer (model.nope_layers): its keys are cached unrotated
        ("mha", {"nope_layers": [1]}),
        # multi-head attention with an output gate (model.attn_output_gate)
        ("mha", {"attn_output_gate": True}),
        # multi-head latent attention: the latent cache, decoded through kv_b_proj absorbed
        ("mla", {}),
        # Gated DeltaNet beside multi-head attention (a hybrid), and alone (every layer linear)
        ("gdn", {}),
        ("gdn", {"attention_kind": "gdn", "layer_types": None}),
        # no low-rank query (DeepSeek-V2-Lite, Moonlight), DeepSeek's interleaved rotated pairs, biases,
        # a local layer (its latents in a ring), a gate and sinks
        (
            "mla",
            {
                "mla": {**MLA, "q_lora_rank": None, "rope_interleave": True},
                "qkv_bias": True,
                "sliding_window": 8,
                "layer_types": ["local", "global"],
                "attn_output_gate": True,
                "attn_sinks": True,
            },
        ),
    ],
)
def test_a_new_kind_decodes_through_every_cache_as_it_recomputes(stub_kinds, kind, over):
    # Gated DeltaNet's chunked form (the full pass, a prefill) and its step-by-step form (decoding) round
    # differently in fp32: up to 1.1e-5 on these logits with every layer linear
    decodes_through_every_cache_as_it_recomputes(tiny(kind, **over), atol=2e-5 if kind == "gdn" else 1e-5)


@pytest.mark.parametrize("attention", ["eager", "sdpa", pytest.param("triton", marks=pytest.mark.long)])
def test_attention_sinks_decode_through_every_cache_as_they_recompute(attention):
    """model.attn_sinks (gpt-oss) with a local and a global layer: the growing, rolling and static caches,
    serve's slot cache and rollouts (each a mask, or a query shorter than the keys) equal the full forward."""
    over = dict(attention=attention, attn_sinks=True, sliding_window=8, layer_types=["local", "global"])
    # head_dim 16: the Triton kernel's least
    model = tiny("mha", d_model=64, **over)
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    # logits of ~2: fp32 rounding of the float mask's kernel reaches 1.1e-5 (sdpa)
    decodes_through_every_cache_as_it_recomputes(model, atol=5e-5)


def decodes_through_every_cache_as_it_recomputes(model, atol=1e-5):
    seq = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(1))  # [B, T]
    with torch.no_grad():
        full = model(seq).logits  # [B, T, V]
        # the growing cache: a prefill, then one token at a time
        cache = KVCache(model.cfg, batch_size=2)
        got = [model(seq[:, :7], cache=cache, logits_to_keep=1).logits[:, -1]]
        for t in range(7, 20):
            got.append(model(seq[:, t : t + 1], cache=cache, logits_to_keep=1).logits[:, -1])
        torch.testing.assert_close(torch.stack(got, dim=1), full[:, 6:], atol=atol, rtol=0)
        # the static cache: positions as a tensor, attention over the whole cache under its mask
        static = StaticKVCache(model.cfg, batch_size=2)
        static.positions = torch.arange(7)
        got = [model(seq[:, :7], cache=static, logits_to_keep=1).logits[:, -1]]
        for t in range(7, 20):
            static.positions = torch.tensor([t])
            got.append(model(seq[:, t : t + 1], cache=static, logits_to_keep=1).logits[:, -1])
        torch.testing.assert_close(torch.stack(got, dim=1), full[:, 6:], atol=atol, rtol=0)

    # greedy through every decode path: the same tokens as recomputing the whole sequence each step
    greedy = SampleOptions(max_new_tokens=12, temperature=0)
    want = generate(model, PROMPT, greedy, use_cache=False).tokens[0]
    assert len(set(want)) > 3
    assert generate(model, PROMPT, greedy).tokens[0] == want
    static_opts = SampleOptions(max_new_tokens=12, temperature=0, decode="static")
    assert generate(model, PROMPT, static_opts).tokens[0] == want
    # serve's slot cache: two prompts at once, the second joining with its own positions
    params = SamplingParams(max_new_tokens=12, temperature=0)
    served = generate_many(model, [PROMPT, PROMPT[:3]], params, max_batch=2)
    assert served[0].choices[0].tokens == want
    alone = generate(model, PROMPT[:3], greedy, use_cache=False).tokens[0]
    assert served[1].choices[0].tokens == alone
    rolled = sample_groups(model, [PROMPT], [[1, 2]], RolloutOptions(12, temperature=0), [12])
    assert [c.tokens for c in rolled[0]] == [want, want]
    # GRPO's engine: both prompts' groups in one continuous batch
    rolled = sample_groups_batched(
        model, [PROMPT[:3], PROMPT], [[1], [2, 3]], RolloutOptions(12, 0), [12, 12]
    )
    assert [[c.tokens for c in g] for g in rolled] == [[alone], [want, want]]


def test_a_state_cannot_be_rewound_and_restarts_from_zero(stub_kinds):
    model = tiny("running_state")
    cache = KVCache(model.cfg, batch_size=1)
    with torch.no_grad():
        model(torch.tensor([PROMPT]), cache=cache)
    assert cache.length == len(PROMPT) and cache.states[0].abs().sum() > 0
    # a state holds every position folded in: taking one back empties the cache
    assert cache.rewind(len(PROMPT)) == len(PROMPT) and cache.rewind(3) == 0
    assert cache.states[0].abs().sum() == 0


@pytest.mark.parametrize("kind", ["running_state", "hybrid"])
def test_a_state_starts_over_when_generation_slides_past_the_context(stub_kinds, kind):
    model = tiny(kind, max_seq_len=12)
    want = generate(model, PROMPT, SampleOptions(max_new_tokens=20, temperature=0), use_cache=False)
    assert want.slides > 0
    for decode in ("eager", "static"):
        opts = SampleOptions(max_new_tokens=20, temperature=0, decode=decode)
        assert generate(model, PROMPT, opts).tokens == want.tokens


def test_no_transformers_family_claims_another_kind(stub_kinds):
    from gptkit.errors import GptkitError
    from gptkit.hf.families import family_of

    family_of(tiny("mha").cfg)
    with pytest.raises(GptkitError, match="attention_kind=wide_values .*refusing"):
        family_of(tiny("wide_values").cfg)


# the kinds of the table, not the stubs: each must be counted exactly, and decode as it recomputes
KINDS = list(ATTENTION_KINDS)


BLOCKS = {
    "plain": {},
    "sinks": {"attn_sinks": True},
    # with q/k/v biases: the gate's projection has one too
    "output-gate": {"attn_output_gate": True, "qkv_bias": True},
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("blocks", BLOCKS)
def test_every_kind_of_the_table_is_counted_and_cached_exactly(kind, blocks):
    """A new kind's row is not done until the accounting counts its module's parameters (attention sinks and
    output gates included, and Muon's share) and its layout gives the tensors its module writes to the
    cache."""
    from gptkit.training.optim import muon_split

    # QK-norms are multi-head attention's (MLA normalizes its latent and its low-rank query)
    qk_norm = {"qk_norm": "head"} if kind == "mha" else {}
    # Gated DeltaNet's layer beside a local one (the sinks and gates are the local layer's)
    types = ["linear", "local"] if kind == "gdn" else ["local", "global"]
    over = dict(sliding_window=8, layer_types=types, **qk_norm, **BLOCKS[blocks])
    model = tiny(kind, **over)
    counts = accounting.count_params(model.cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert accounting.muon_params(model.cfg) == sum(p.numel() for _, p in muon_split(model)[0])
    assert counts.attention == sum(p.numel() for b in model.blocks for p in b.attn.parameters()) - sum(
        p.numel() for b in model.blocks for n, p in b.attn.named_parameters() if "norm" in n
    )
    cache = KVCache(model.cfg, batch_size=1, max_len=16)
    with torch.no_grad():
        model(torch.tensor([PROMPT]), cache=cache)
    assert cache.nbytes == accounting.kv_cache_bytes(model.cfg, 16, "fp32")
    greedy = SampleOptions(max_new_tokens=8, temperature=0)
    assert generate(model, PROMPT, greedy).tokens == generate(model, PROMPT, greedy, use_cache=False).tokens


def test_the_output_gate_is_a_sigmoid_of_the_layer_input_on_each_head_before_o_proj():
    """model.attn_output_gate (Qwen3-Next's): o_proj(attention(x) * sigmoid(gate_proj(x))), against the same
    layer without a gate whose attention output is gated by hand."""
    gated = tiny("mha", attn_output_gate=True, attention="eager")
    plain = GPT(ModelConfig(**{**gated.cfg.to_dict(), "attn_output_gate": False})).eval()
    missing, unexpected = plain.load_state_dict(gated.state_dict(), strict=False)
    assert missing == [] and all(".attn.gate_proj." in k for k in unexpected) and unexpected
    a, b = gated.blocks[0].attn, plain.blocks[0].attn
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    seen = {}
    hook = b.o_proj.register_forward_hook(lambda m, args, out: seen.update(inp=args[0]))
    with torch.no_grad():
        ungated, _ = b(x, rope=plain.rope)
        hook.remove()
        want = a.o_proj(seen["inp"] * torch.sigmoid(a.gate_proj(x)))  # [B, T, d_model]
        got, _ = a(x, rope=gated.rope)
    torch.testing.assert_close(got, want)
    assert (got - ungated).abs().max().item() > 1e-3
    # its projection is counted in the FLOPs as torch counts it
    from torch.utils.flop_counter import FlopCounterMode

    idx = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        gated(idx)
    assert counter.get_total_flops() == accounting.flops_per_token(gated.cfg, 32).forward_dense * 2 * 32
