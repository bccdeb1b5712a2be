"""Gated DeltaNet (model.layer_types `linear`, or model.attention_kind=gdn): Qwen3-Next's linear attention.

    x [B, T, d_model] -> in_proj_qkvz -> q, k [B, T, n_key_heads, key_head_dim], v, z [B, T, n_value_heads,
                         value_head_dim] (grouped by key head: its q, k, then its value heads' v, z)
                      -> in_proj_ba   -> b, a [B, T, n_value_heads] (grouped the same way)
      -> q, k, v concatenated -> a depthwise causal conv1d of conv_kernel taps (no bias), SiLU
      -> beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (the log of the decay a_t, <= 0)
      -> q, k L2-normalized, q scaled by key_head_dim^-0.5; each key head serves n_value_heads / n_key_heads
         consecutive value heads
      -> the gated delta rule, per value head, a state S [key_head_dim, value_head_dim]:
             S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,    o_t = S_t^T q_t
         (= a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T), computed chunk-wise in training and
         prefill (chunk_gated_delta_rule) and step by step in decoding (recurrent_gated_delta_rule)
      -> a gated RMSNorm per value head, RMSNorm(o) * silu(z) -> [B, T, n_value_heads * value_head_dim]
      -> out_proj -> [B, T, d_model]

The parameter names and layouts are transformers' Qwen3NextGatedDeltaNet's (in_proj_qkvz, in_proj_ba,
conv1d, A_log, dt_bias, norm, out_proj), or with model.gdn.layout=split Qwen3_5GatedDeltaNet's (in_proj_qkv:
all q, all k, all v rows; in_proj_z, in_proj_b, in_proj_a: the same computation, the rows held apart), and
so is the arithmetic (tests/model/test_gated_deltanet.py holds both functions to transformers'
torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule).

The chunked form (the WY / UT transform of DeltaNet, chunk C = model.gdn.chunk_size): within a chunk the C
delta-rule updates are one triangular solve, (I + strictly_lower(beta_i k_i.k_j exp(G_i - G_j))) U = beta V
(G the cumulative log decay inside the chunk), then the chunk reads the state carried in and writes its
update with matmuls; only the loop over chunks is sequential (docs/linear-attention.md).

Packed documents (docs=): the state and the convolution start from zero at each document's first token,
in both forms, so a packed row equals its documents run apart.

Decoding keeps no K/V: the layer's cache layout (gptkit/model/attention_kinds.py) is one fixed-size state per
sequence, the delta-rule state [n_value_heads, key_head_dim, value_head_dim] and the convolution's last
conv_kernel - 1 inputs [conv_dim, conv_kernel - 1], flattened into one vector (GDNConfig.state_shape,
GatedDeltaNet.split_state),
read and written in place through `cache.state(layer, like)`.

The backend: with model.attention=triton the chunked form runs our Triton kernel
(kernels/gptkit_kernels/gated_delta.py: forward and backward, equal to chunk_gated_delta_rule) where Triton
can run (CUDA tensors, or TRITON_INTERPRET=1), the PyTorch function elsewhere (one warning per process); a
chunk size or head dim it cannot take is a ConfigError when the layer is built. eager and sdpa run the PyTorch
functions. Decoding one token always runs the step-by-step form.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gptkit.errors import ConfigError
from gptkit.model.config import ModelConfig
from gptkit.model.documents import Documents
from gptkit.model.fused import triton_available, warn_once


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last axis (transformers' and FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _fp32(fn):
    """fn computed in fp32 under autocast too (it casts its inputs to fp32; autocast would run its matmuls
    and solves in bf16 again)."""

    @functools.wraps(fn)
    def wrapper(q, *args, **kwargs):
        with torch.autocast(q.device.type, enabled=False):
            return fn(q, *args, **kwargs)

    return wrapper


def _prepare(q, k, v, g, beta):
    """The inputs of both forms in the layout they compute in: q, k repeated over the value heads of their
    group, L2-normalized, q scaled by key_head_dim^-0.5; all fp32 and [B, H_v, T, ...]."""
    h_k, h_v = k.shape[2], v.shape[2]
    if h_k != h_v:
        q = q.repeat_interleave(h_v // h_k, dim=2)
        k = k.repeat_interleave(h_v // h_k, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float().contiguous() for x in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


@_fp32
def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    resets: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one position at a time (decoding; the definition the chunked form is held to).

    q, k [B, T, H_k, d_k], v [B, T, H_v, d_v], g (log decay, <= 0) and beta [B, T, H_v]; initial_state
    [B, H_v, d_k, d_v] or None (zeros); resets [B, T] bool or None: the state restarts from zero at those
    positions (a packed document's first token). Returns (o [B, T, H_v, d_v] in q's dtype, the final state
    [B, H_v, d_k, d_v] fp32)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, d_k = k.shape
    S = q.new_zeros(B, H, d_k, v.shape[-1]) if initial_state is None else initial_state.float()
    keep = None if resets is None else (~resets).float()  # [B, T]
    out = []
    for t in range(T):
        decay = g[:, :, t].exp()  # [B, H]
        if keep is not None:
            decay = decay * keep[:, t, None]
        S = S * decay[..., None, None]
        k_t = k[:, :, t]  # [B, H, d_k]
        # what the state already predicts for k_t, and the correction written back (the delta rule)
        delta = (v[:, :, t] - (S * k_t[..., None]).sum(-2)) * beta[:, :, t, None]  # [B, H, d_v]
        S = S + k_t[..., None] * delta[..., None, :]
        out.append((S * q[:, :, t, :, None]).sum(-2))  # [B, H, d_v]
    o = torch.stack(out, dim=1) if out else v.new_zeros(B, 0, H, v.shape[-1])
    return o.to(dtype), S


@_fp32
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = 64,
    initial_state: Optional[torch.Tensor] = None,
    resets: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule chunk by chunk (the WY / UT-transform form); the arguments and the result are
    recurrent_gated_delta_rule's, equal to it (fp32) for any `chunk`.

    Per chunk of C positions (G the cumulative log decay from the chunk's start, D[i, j] = exp(G_i - G_j)
    for j <= i inside one document, else 0):
        A = I + strictly_lower((beta k) k^T * D)          the UT system, unit lower triangular
        U = A^-1 (beta v),  W = A^-1 (beta k exp(G))      the chunk's updates and state reads
        V' = U - W S                                      the corrections against the carried state
        O = (q exp(G)) S + ((q k^T) * D) V'               what each position reads
        S <- exp(G_C) S + (k exp(G_C - G))^T V'           the state carried to the next chunk
    A document starting at position i of a chunk cuts every factor that would carry across it: the carried
    state does not reach i or later, nothing before i reaches the chunk's end."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, d_k = k.shape
    d_v = v.shape[-1]
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    N = (T + pad) // chunk
    # [B, H, N, C, d] and [B, H, N, C]
    q, k, v = (x.reshape(B, H, N, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(B, H, N, chunk), beta.reshape(B, H, N, chunk)
    G = g.cumsum(-1)  # [B, H, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()  # j <= i
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [B, H, N, C, C]
    # the documents: c counts the starts inside the chunk up to each position
    carry_in = carry_out = keep = None
    if resets is not None:
        c = F.pad(resets.long(), (0, pad)).reshape(B, 1, N, chunk).cumsum(-1)  # [B, 1, N, C]
        D = D * (c[..., :, None] == c[..., None, :])  # i and j in one document
        carry_in = (c == 0).float()  # the carried state reaches position i
        carry_out = (c == c[..., -1:]).float()  # position j's write reaches the chunk's end
        keep = carry_in[..., -1]  # [B, 1, N]: the carried state survives the chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)) * D  # its diagonal is read as 1 (unitriangular)
    decay_in = G.exp() if carry_in is None else G.exp() * carry_in  # [B, H, N, C]
    U = torch.linalg.solve_triangular(A, v_beta, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A, k_beta * decay_in[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * D  # [B, H, N, C, C]
    q_in = q * decay_in[..., None]
    decay_out = (G[..., -1:] - G).exp()
    if carry_out is not None:
        decay_out = decay_out * carry_out
    k_out = k * decay_out[..., None]
    chunk_decay = G[..., -1].exp()  # [B, H, N]
    if keep is not None:
        chunk_decay = chunk_decay * keep
    S = q.new_zeros(B, H, d_k, d_v) if initial_state is None else initial_state.float()
    # the chunks in order, each read through unbind and the outputs stacked once: indexing U[:, :, n] (or
    # writing out[:, :, n]) in the loop would make every chunk's backward a whole [B, H, N, ...] tensor,
    # a backward growing with T^2 (16k tokens, 4 heads of 32: 4.6 s against 0.4 s on one CPU thread)
    chunks = zip(
        U.unbind(2), W.unbind(2), q_in.unbind(2), intra.unbind(2), k_out.unbind(2), chunk_decay.unbind(2)
    )
    out = []
    for u, w, q_n, intra_n, k_n, decay_n in chunks:
        v_new = u - w @ S  # [B, H, C, d_v]
        out.append(q_n @ S + intra_n @ v_new)
        S = S * decay_n[..., None, None] + k_n.transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(B, H, N * chunk, d_v)[:, :, :T].transpose(1, 2)  # [B, T, H, d_v]
    return o.contiguous().to(dtype), S


@_fp32
def triton_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = 64,
    initial_state: Optional[torch.Tensor] = None,
    resets: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_gated_delta_rule (the same arguments and result) by the Triton kernel of
    gptkit_kernels.gated_delta; the documents go in as each position's running count of resets."""
    from gptkit_kernels.gated_delta import chunk_gated_delta_rule as kernel

    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    seg = None if resets is None else resets.int().cumsum(-1, dtype=torch.int32)
    o, S = kernel(q, k, v, g, beta, chunk, initial_state, seg)
    return o.transpose(1, 2).contiguous().to(dtype), S


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: Optional[torch.Tensor] = None,
    start: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the depthwise causal convolution of x [B, T, C] by weight [C, K] (transformers' conv1d of K
    taps, padded K - 1 on the left): out_t = sum_j weight[:, K-1-j] x_{t-j}. state [B, C, K - 1]: the inputs
    before x (None: zeros); start [B, T] or None: each position's document start, inputs before it read as
    zeros. Returns (out [B, T, C], the new state [B, C, K - 1]: the last K - 1 inputs)."""
    B, T, C = x.shape
    K = weight.shape[1]
    prev = x.new_zeros(B, K - 1, C) if state is None else state.transpose(1, 2).to(x.dtype)
    xp = torch.cat([prev, x], dim=1)  # [B, K - 1 + T, C]
    w = weight.to(x.dtype)
    if start is None:
        # one document: torch's depthwise convolution over the state and x (transformers' own call)
        out = F.conv1d(xp.transpose(1, 2), w[:, None], groups=C).transpose(1, 2)  # [B, T, C]
    else:
        # tap by tap, each input outside the position's document zeroed
        t = torch.arange(T, device=x.device)
        out = torch.zeros_like(x)
        for j in range(K):
            tap = xp[:, K - 1 - j : K - 1 - j + T]  # x_{t-j}: [B, T, C]
            out = out + tap * (t - j >= start)[..., None].to(x.dtype) * w[:, K - 1 - j]
    return F.silu(out), xp[:, T:].transpose(1, 2)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * silu(gate) over each value head (transformers' Qwen3NextRMSNormGated: the statistics in
    fp32, the weight applied in the input's dtype, the gate in fp32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (a `linear` layer of model.layer_types; model.gdn its shapes): see the module docstring.
    Called as every attention kind is, `y, probs = attn(x, rope=, cache=, positions=, docs=, return_probs=)`;
    it reads no rope and no positions and returns no probabilities."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        g = cfg.gdn
        self.layer = layer
        self.h_k, self.h_v = g.n_key_heads, g.n_value_heads
        self.d_k, self.d_v = g.key_head_dim, g.value_head_dim
        self.key_dim, self.value_dim = self.h_k * self.d_k, self.h_v * self.d_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel, self.chunk = g.conv_kernel, g.chunk_size
        self.triton = cfg.attention == "triton"
        if self.triton and importlib.util.find_spec("triton") is not None:
            from gptkit_kernels.gated_delta import unsupported

            reason = unsupported(self.chunk, self.d_k, self.d_v)
            if reason is not None:
                raise ConfigError(
                    f"model.attention=triton runs the linear layers' Triton kernel, which cannot take "
                    f"{reason}; change model.gdn or set model.attention=sdpa"
                )
        # model.gdn.layout: the same projections, their rows held as Qwen3-Next's files hold them or as
        # Qwen3.5's do
        self.layout = g.layout
        if g.layout == "split":
            self.in_proj_qkv = nn.Linear(cfg.d_model, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(cfg.d_model, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(cfg.d_model, self.h_v, bias=False)
            self.in_proj_a = nn.Linear(cfg.d_model, self.h_v, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(cfg.d_model, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(cfg.d_model, 2 * self.h_v, bias=False)
        # depthwise: a weight [conv_dim, 1, K] as transformers' nn.Conv1d holds it (applied by causal_conv1d)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            self.kernel,
            groups=self.conv_dim,
            padding=self.kernel - 1,
            bias=False,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.h_v))
        self.A_log = nn.Parameter(torch.zeros(self.h_v))
        self.norm = GatedRMSNorm(self.d_v, cfg.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.d_model, bias=False)
        self.init_std, self.n_layers = cfg.init_std, cfg.n_layers
        # model.dropout on the output, as every attention kind's
        self.dropout = cfg.dropout
        self.init_own_parameters()

    @torch.no_grad()
    def init_own_parameters(self) -> None:
        """transformers' initialization of what GPT.reset_parameters' rule does not fit: A = uniform(0.01, 16)
        (A_log its log), dt_bias 1, the gated norm's weight 1, the conv1d's own (Kaiming uniform); out_proj
        a residual projection, N(0, init_std / sqrt(2 n_layers))."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log_())
        self.dt_bias.fill_(1.0)
        self.norm.weight.fill_(1.0)
        self.conv1d.reset_parameters()
        self.out_proj.weight.normal_(0.0, self.init_std / math.sqrt(2 * self.n_layers))

    def chunked(self, x: torch.Tensor):
        """The chunked form for model.attention: the Triton kernel under triton where it can run, else the
        PyTorch function (one warning per process)."""
        if not self.triton:
            return chunk_gated_delta_rule
        if triton_available(x.device):
            return triton_chunk_gated_delta_rule
        warn_once(
            "triton-gdn",
            "model.attention=triton needs triton and CUDA tensors (or TRITON_INTERPRET=1) for the linear "
            "layers' kernel; running the PyTorch chunked delta rule",
        )
        return chunk_gated_delta_rule

    def split_state(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of a flat decode state [B, *state_shape]: the delta-rule state [B, H_v, d_k, d_v] and the
        conv state [B, conv_dim, K - 1] (written in place through them)."""
        B = state.shape[0]
        n = self.h_v * self.d_k * self.d_v
        return (
            state[:, :n].view(B, self.h_v, self.d_k, self.d_v),
            state[:, n:].view(B, self.conv_dim, self.kernel - 1),
        )

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, d_model] -> (q, k, v concatenated [B, T, conv_dim], z [B, T, H_v, d_v], b, a [B, T, H_v]),
        from the projections of model.gdn.layout."""
        B, T, _ = x.shape
        if self.layout == "split":
            z = self.in_proj_z(x).view(B, T, self.h_v, self.d_v)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = self.h_v // self.h_k
        # each key head's q, k, then its r value heads' v, z (and b, a): transformers' grouping
        qkvz = self.in_proj_qkvz(x).view(B, T, self.h_k, 2 * self.d_k + 2 * r * self.d_v)
        q, k, v, z = qkvz.split([self.d_k, self.d_k, r * self.d_v, r * self.d_v], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, self.h_k, 2 * r).split([r, r], dim=-1)
        z = z.reshape(B, T, self.h_v, self.d_v)
        b, a = b.reshape(B, T, self.h_v), a.reshape(B, T, self.h_v)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        return mixed, z, b, a

    def forward(
        self,
        x: torch.Tensor,
        *,
        rope=None,
        cache=None,
        positions: int | torch.Tensor = 0,
        docs: Optional[Documents] = None,
        return_probs: bool = False,
    ):
        """x [B, T, d_model] -> ([B, T, d_model], None)."""
        B, T, _ = x.shape
        mixed, z, b, a = self.project(x)
        S0 = conv0 = None
        if cache is not None:
            S0, conv0 = self.split_state(cache.state(self.layer, x))
        start = None if docs is None else docs.start.long()  # [B, T]
        mixed, conv_state = causal_conv1d(mixed, self.conv1d.weight[:, 0], conv0, start)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.view(B, T, self.h_k, self.d_k), k.view(B, T, self.h_k, self.d_k)
        v = v.view(B, T, self.h_v, self.d_v)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [B, T, H_v]
        resets = None if start is None else start == torch.arange(T, device=x.device)  # [B, T]
        if T == 1:
            o, S = recurrent_gated_delta_rule(q, k, v, g, beta, S0, resets)
        else:
            o, S = self.chunked(x)(q, k, v, g, beta, self.chunk, S0, resets)
        if cache is not None:
            S0.copy_(S)
            conv0.copy_(conv_state)
        y = self.norm(o, z).reshape(B, T, self.value_dim)
        return F.dropout(self.out_proj(y), self.dropout, self.training), None
