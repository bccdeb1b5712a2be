"""Batch-invariant forward passes (grpo.batch_invariant): bits of one token that do not depend on the rest of
the batch.

    with batch_invariant(model):
        model(ids, cache=cache)         # a decode step of n rows through the KV cache (the sampler)
        model(x, y, token_logps=True)   # one teacher-forced forward over [B, T] (the trainer)

Inside, on CPU tensors, each output element is computed one way whatever comes with it: never by the number
of rows (batch x sequence, or a chunk of them), nor by the number of keys a query sees. The
sampler's log-prob of a token and the trainer's are then the same bits in fp32
(tests/model/test_batch_invariant.py; docs/grpo.md). What torch does otherwise, measured on torch 2.13 (CPU,
AVX512, 2 threads): a [1, 128] x [128, 384] matmul differs in the last bits from the same row
inside a [7+, 128] one (the BLAS takes another kernel for one or two rows); F.silu, torch.sigmoid and F.gelu
give another last bit in the scalar tail of a tensor than in its vectorized body (817 of 20,000 silu values),
so a token's value depended on where its row fell; SDPA's CPU kernel sums a query's keys in blocks, whose
split depends on how many keys there are.

The ops, one definition each (a TorchFunctionMode: the model code is unchanged):

    linear, mm, matmul (a 2-D right operand)   one gemm whose row count is padded with zero rows to a multiple
                                               of ROWS: every row runs the same kernel, at any row count
                                               (measured for M = 1..40, 44..1,500 and row offsets 0, 1, 3)
    mean over the last dim (RMSNorm), rms_norm, layer_norm, softmax, log_softmax, logsumexp (last dim)
                                               row_sum: one gemm of the rows against a column of ones,
                                               in fp32, rows padded as a linear's (the reduced length is
                                               fixed: d_model, the vocabulary, the keys below); max is exact
                                               in any order
    silu, sigmoid, gelu                        from exp, tanh, +, x, / (each the same in torch's vectorized
                                               body and scalar tail; silu and gelu themselves are not)
    attention (every layer's backend, swapped  the keys zero-padded to the model's max_seq_len: scores and
    for the mode's duration)                   the values' weighted sum batched gemms of padded rows over
                                               a fixed number of positions, the softmax's sum a row_sum
                                               over them, the sink added after it: a query sees its keys 0..p
                                               alike whether a KV cache holds p + 1 of them or a causal
                                               mask hides the T - p - 1 after it (they weigh exact 0)

What stays as it was: tensors on other devices (a GPU path needs kernels of its own: a matmul with one tile
config and no split-K, fixed-order norms and log-softmax, an attention kernel with a fixed KV split, as
Thinking Machines' batch_invariant_ops and vLLM's VLLM_BATCH_INVARIANT do; not built here), the backward pass
(gradients need no invariance), sliding windows and packed documents (a rolling cache holds its keys in ring
order), dropout and attention maps: those layers run their own backend. rollout_logprob_diff (GRPO) measures
what remains, and grpo.is_correction corrects for it.

Cost: the padded gemms and the ops spelled out cost more than torch's fused kernels; docs/grpo.md gives
tokens/s of the invariant forward beside the plain one.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from gptkit.model.attention import by_segment, window_mask
from gptkit.model.fused import warn_once

# every gemm's row count is a multiple of this (the BLAS runs its small-row kernels below ~8 rows)
ROWS = 16
# elements of one query chunk's [B, H, C, keys] scores in the attention
CHUNK_ELEMENTS = 1 << 23


def _last(dim: Any, x: torch.Tensor) -> bool:
    return isinstance(dim, int) and dim % max(x.dim(), 1) == x.dim() - 1


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., K] @ b [K, N] -> [..., N]: one gemm of the rows padded with zero rows to a multiple of ROWS."""
    k = a.shape[-1]
    rows = a.reshape(-1, k)  # [M, K]
    m = rows.shape[0]
    padded = -(-max(m, 1) // ROWS) * ROWS
    if padded != m:
        rows = F.pad(rows, (0, 0, 0, padded - m))  # [M', K]
    return torch.mm(rows, b)[:m].reshape(*a.shape[:-1], b.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear: x @ weight^T (+ bias, added after)."""
    y = matmul(x, weight.t())
    return y if bias is None else y + bias


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over its last dim (removed): one gemm of its rows against a column of ones (matmul: rows
    padded to a multiple of ROWS), so a row's sum is computed alike at any row count, as a linear's row."""
    with torch.autocast(x.device.type, enabled=False):
        # in fp32 (or wider) under autocast too: a norm's statistics, a softmax's denominator
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return matmul(x, x.new_ones(x.shape[-1], 1)).squeeze(-1)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) over the last dim: max + log(row_sum(exp(x - max)))."""
    m = x.amax(dim=-1, keepdim=True)  # [..., 1]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m.squeeze(-1) + torch.log(row_sum(torch.exp(x - m)))


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return x - logsumexp(x).unsqueeze(-1)


def softmax(x: torch.Tensor) -> torch.Tensor:
    m = x.amax(dim=-1, keepdim=True)  # [..., 1]
    e = torch.exp(x - m)
    return e / row_sum(e).unsqueeze(-1)


def mean(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    s = row_sum(x) / x.shape[-1]
    return s.unsqueeze(-1) if keepdim else s


def layer_norm(x, shape, weight=None, bias=None, eps=1e-5) -> torch.Tensor:
    """F.layer_norm over the last dim (shape of one element)."""
    mu = mean(x, keepdim=True)
    d = x - mu
    y = d / torch.sqrt(mean(d * d, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


def rms_norm(x, shape, weight=None, eps=None) -> torch.Tensor:
    """F.rms_norm over the last dim, as layers.RMSNorm's own formula (fp32 statistics, the weight after), so
    its inference path (torch's rms_norm) gives the training path's bits under the mode."""
    h = x.float()
    eps = torch.finfo(h.dtype).eps if eps is None else eps
    h = (h * torch.rsqrt(mean(h.pow(2), keepdim=True) + eps)).to(x.dtype)
    return h if weight is None else weight * h


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., M, K] with zero rows after its M to a multiple of ROWS (a batched gemm's rows, as matmul's)."""
    m = x.shape[-2]
    padded = -(-max(m, 1) // ROWS) * ROWS
    return F.pad(x, (0, 0, 0, padded - m)) if padded != m else x


@by_segment
def attention(
    q,
    k,
    v,
    *,
    causal=True,
    mask=None,
    dropout_p=0.0,
    scale=None,
    return_probs=False,
    docs=None,
    window=None,
    softcap=None,
    sinks=None,
    keys: int | None = None,
    fallback: Callable[..., Any] | None = None,
):
    """The attention backend of the mode (gptkit/model/attention.py's signature): q [B, H, Tq, D], k and v
    [B, Hkv, Tk, D or Dv], queries bottom-right aligned with the keys. The keys are zero-padded to a fixed
    `keys` (the model's max_seq_len: Tk where None), so that every query reduces over the same number of key
    positions whether a KV cache holds p + 1 of them or a causal mask hides the rest (they score -inf, weigh
    exact 0): scores one batched gemm over head_dim, the masked softmax's sum a row_sum over the `keys`
    positions, the values' weighted sum one batched gemm over them, each gemm's rows padded to a multiple of
    ROWS. On another device, with dropout, probabilities, packed documents, a window or more keys than
    `keys`: `fallback`, the layer's own backend."""
    args = dict(causal=causal, mask=mask, dropout_p=dropout_p, scale=scale, return_probs=return_probs)
    args.update(docs=docs, window=window, softcap=softcap, sinks=sinks)
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    L = keys or Tk
    if (
        q.device.type != "cpu"
        or dropout_p > 0
        or return_probs
        or docs is not None
        or window is not None
        or Tk > L
    ):
        return fallback(q, k, v, **args)
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # [B, H, Tk, D]
        v = v.repeat_interleave(H // Hkv, dim=1)  # [B, H, Tk, Dv]
    k = F.pad(k, (0, 0, 0, L - Tk)).transpose(-1, -2)  # [B, H, D, L]
    v = F.pad(v, (0, 0, 0, L - Tk))  # [B, H, L, Dv]
    scale = D**-0.5 if scale is None else scale
    if mask is not None:
        keep = mask
    elif causal:
        keep = window_mask(Tq, Tk, None, q.device)  # [Tq, Tk]
    else:
        keep = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    keep = F.pad(keep, (0, L - Tk), value=False)  # [..., Tq, L]: the pad is never seen
    while keep.dim() < 4:
        keep = keep[None]
    chunk = max(ROWS, CHUNK_ELEMENTS // max(1, B * H * L) // ROWS * ROWS)
    outs = []
    for s in range(0, Tq, chunk):
        e = min(s + chunk, Tq)
        scores = (_rows(q[:, :, s:e]) @ k)[:, :, : e - s] * scale  # [B, H, C, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~keep[..., s:e, :], float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)  # [B, H, C, 1]
        if sinks is not None:
            sink = sinks.float().view(1, H, 1, 1)
            m = torch.maximum(m, sink)
        w = torch.exp(scores - m)  # [B, H, C, L], 0 where masked
        total = row_sum(w)[..., None]  # [B, H, C, 1]
        if sinks is not None:
            total = total + torch.exp(sink - m)
        outs.append((_rows(w / total) @ v)[:, :, : e - s])  # [B, H, C, Dv]
    return torch.cat(outs, dim=2).to(dtype), None


def _plain(t: Any) -> bool:
    """A plain CPU tensor (or parameter): not a subclass with ops of its own (NF4, DTensor), not on a GPU."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"


def _matmul_args(args) -> bool:
    a, b = args[0], args[1]
    return _plain(a) and _plain(b) and a.dim() >= 2 and b.dim() == 2


_MATMULS = {torch.mm, torch.matmul, torch.Tensor.mm, torch.Tensor.matmul, torch.Tensor.__matmul__}
_ELEMENTWISE = {
    F.silu: silu,
    torch.sigmoid: sigmoid,
    torch.Tensor.sigmoid: sigmoid,
    F.sigmoid: sigmoid,
    F.gelu: gelu,
}
_LAST_DIM = {
    torch.softmax: softmax,
    torch.Tensor.softmax: softmax,
    F.softmax: softmax,
    torch.log_softmax: log_softmax,
    torch.Tensor.log_softmax: log_softmax,
    F.log_softmax: log_softmax,
    torch.logsumexp: logsumexp,
    torch.Tensor.logsumexp: logsumexp,
}


_HANDLED = {
    F.linear,
    F.layer_norm,
    F.rms_norm,
    torch.mean,
    torch.Tensor.mean,
    *_MATMULS,
    *_ELEMENTWISE,
    *_LAST_DIM,
}


def _dim(args, kwargs, at: int = 1):
    return kwargs.get("dim", args[at] if len(args) > at else None)


class InvariantOps(TorchFunctionMode):
    """The CPU ops of the module docstring, in place of torch's, while the mode is on."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # every other op (most calls) as it is, first; and an op writing into `out=`
        if func not in _HANDLED or "out" in kwargs:
            return func(*args, **kwargs)
        x = args[0] if args else None
        if not (_plain(x) and x.is_floating_point()):
            return func(*args, **kwargs)
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            return linear(*args, **kwargs) if _plain(weight) else func(*args, **kwargs)
        if func in _MATMULS and len(args) == 2 and not kwargs and _matmul_args(args):
            return matmul(*args)
        if func in _ELEMENTWISE:
            return _ELEMENTWISE[func](*args, **kwargs)
        if func in _LAST_DIM and _last(_dim(args, kwargs), x) and kwargs.get("dtype") is None:
            if func in (torch.logsumexp, torch.Tensor.logsumexp):
                keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
                return logsumexp(x).unsqueeze(-1) if keepdim else logsumexp(x)
            return _LAST_DIM[func](x)
        if func in (torch.mean, torch.Tensor.mean) and _last(_dim(args, kwargs), x):
            keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            if kwargs.get("dtype") is None:
                return mean(x, keepdim=bool(keepdim))
        if func is F.layer_norm:
            shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else ())
            if len(shape) == 1:
                return layer_norm(*args, **kwargs)
        if func is F.rms_norm:
            shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else ())
            if len(shape) == 1:
                return rms_norm(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant(model: torch.nn.Module | None = None, enabled: bool = True) -> Iterator[None]:
    """Within: the mode's ops (InvariantOps) and, for every attention layer of `model`, the mode's attention
    in place of its backend (restored on exit). enabled=False: nothing changes. A model on another device than
    the CPU runs as it is (once said)."""
    if not enabled:
        yield
        return
    layers = [] if model is None else [m for m in model.modules() if callable(getattr(m, "attend", None))]
    device = next((p.device for p in model.parameters()), None) if model is not None else None
    if device is not None and device.type != "cpu":
        warn_once(
            "batch-invariant-device",
            f"grpo.batch_invariant: the batch-invariant ops are the CPU path's; on {device.type} the model "
            "runs its own kernels (train/rollout_logprob_diff shows the mismatch; grpo.is_correction "
            "corrects for it)",
        )
    saved = [(m, m.attend, getattr(m, "attend_cached", None)) for m in layers]
    # every query reduces over this many key positions (the model's longest sequence)
    keys = getattr(getattr(model, "cfg", None), "max_seq_len", None)
    try:
        for m, own, cached in saved:
            m.attend = functools.partial(attention, keys=keys, fallback=own)
            if cached is not None:
                m.attend_cached = functools.partial(attention, keys=keys, fallback=cached)
        with InvariantOps():
            yield
    finally:
        for m, own, cached in saved:
            m.attend = own
            if cached is not None:
                m.attend_cached = cached
