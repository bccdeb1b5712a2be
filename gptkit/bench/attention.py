"""`gptkit bench attention`: our Triton FlashAttention against PyTorch SDPA's flash and cuDNN backends.

For every T in bench.seq_lens (batch = bench.tokens // T), head dim, causal or not, and GQA ratio,
and every backend in bench.backends (SDPA's first, so that ours can be compared with the fastest):
  1. check (ours): output and dQ/dK/dV against SDPA flash (max |diff| / max |sdpa| <= bench.check_tol);
  2. time forward, backward and forward+backward with triton.testing.do_bench (median, after warm-up).
Backends: triton (our FA2 kernels, the default implementation), triton-tma (the Hopper TMA kernels),
triton-tma-ws (the same, warp-specialized forward), sdpa-flash, sdpa-cudnn, eager.
TFLOP/s use the usual convention: forward 4*B*H*T^2*D (halved when causal), backward 2.5x forward.
Each row prints as soon as it is measured (and bench.out is rewritten), so a run cut short keeps
what it measured. Our kernels' autotuning results are cached on disk by Triton (>= 3.4) across
runs. Eager attention may run out of memory at large T: that cell reads "oom". Needs a CUDA GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gptkit.errors import ConfigError, GptkitError
from gptkit.fsio import atomic_write_text

MODES = ("fwd", "bwd", "fwd+bwd")
BACKENDS = ("triton", "triton-tma", "triton-tma-ws", "sdpa-flash", "sdpa-cudnn", "eager")
# backend -> flash_attention impl
OURS = {"triton": "fa2", "triton-tma": "tma", "triton-tma-ws": "tma-ws"}
# backend -> SDPBackend member
SDPA = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
DEVICE = "cuda"


@dataclass
class Case:
    T: int
    batch: int
    head_dim: int
    n_heads: int
    n_kv_heads: int
    causal: bool

    def fwd_flops(self) -> float:
        flops = 4.0 * self.batch * self.n_heads * self.T**2 * self.head_dim
        return flops / 2 if self.causal else flops

    def flops(self, mode: str) -> float:
        return self.fwd_flops() * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


@dataclass
class Result:
    case: Case
    backend: str
    # mode -> median ms; None: see note
    ms: dict[str, float | None] = field(default_factory=dict)
    note: str = ""
    # ours only: the check against SDPA flash
    max_rel_err: float | None = None

    def tflops(self, mode: str) -> float | None:
        ms = self.ms.get(mode)
        return None if ms is None else self.case.flops(mode) / (ms * 1e-3) / 1e12

    def to_dict(self) -> dict:
        d = {**asdict(self.case), "backend": self.backend, "note": self.note, "max_rel_err": self.max_rel_err}
        for mode in MODES:
            d[f"{mode}_ms"] = self.ms.get(mode)
            d[f"{mode}_tflops"] = self.tflops(mode)
        return d


def _cases(cfg) -> list[Case]:
    cases = []
    for T in cfg.seq_lens:
        if T <= 0 or cfg.tokens % T:
            raise ConfigError(f"bench.tokens={cfg.tokens} must be a positive multiple of every T; got T={T}")
        for head_dim in cfg.head_dims:
            if cfg.d_model % head_dim:
                raise ConfigError(f"bench.d_model={cfg.d_model} must be a multiple of head_dim={head_dim}")
            n_heads = cfg.d_model // head_dim
            for group in cfg.gqa:
                if group <= 0 or n_heads % group:
                    raise ConfigError(
                        f"bench.gqa={group} must divide the {n_heads} heads of head_dim={head_dim}"
                    )
                for causal in cfg.causal:
                    cases.append(Case(T, cfg.tokens // T, head_dim, n_heads, n_heads // group, bool(causal)))
    return cases


def _attention(backend: str, causal: bool):
    """(q, k, v) -> out for one backend. sdpa-* must be called inside their sdpa_kernel(...)."""
    from gptkit.model.attention import eager_attention
    from gptkit_kernels import flash_attention

    if backend in OURS:
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, impl=OURS[backend])
    if backend in SDPA:
        return lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
        )
    return lambda q, k, v: eager_attention(q, k, v, causal=causal)[0]


def _inputs(case: Case, dtype, n_kv_heads: int | None = None):
    n_kv = case.n_kv_heads if n_kv_heads is None else n_kv_heads
    # [B, H, T, D]
    q = torch.randn(case.batch, case.n_heads, case.T, case.head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(case.batch, n_kv, case.T, case.head_dim, device=DEVICE, dtype=dtype)  # [B, Hkv, T, D]
    v = torch.randn(case.batch, n_kv, case.T, case.head_dim, device=DEVICE, dtype=dtype)  # [B, Hkv, T, D]
    return [x.requires_grad_() for x in (q, k, v)]


def _grads(fn, q, k, v, dout):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _sdpa_reference(q, k, v, dout, causal):
    """SDPA flash output and grads; K/V repeated per query head (autograd sums their grads back)."""
    group = q.shape[1] // k.shape[1]

    def fn(q, k, v):
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, T, D]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return _grads(fn, q, k, v, dout)


def _max_rel_err(got, want) -> float:
    return max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
        for a, b in zip(got, want)
    )


def _measure(case: Case, backend: str, dtype, cfg) -> Result:
    """Check (triton) and time one backend on one case; out of memory gives None timings."""
    result = Result(case, backend)
    only = sdpa_kernel(getattr(SDPBackend, SDPA[backend])) if backend in SDPA else contextlib.nullcontext()
    try:
        with only:
            _check_and_time(result, dtype, cfg)
    except torch.cuda.OutOfMemoryError:
        result.ms, result.note = {mode: None for mode in MODES}, "oom"
    # e.g. an SDPA backend refusing this GPU or shape; ours must not
    except (RuntimeError, AttributeError) as exc:
        if backend in OURS:
            raise
        first_line = str(exc).splitlines()[0][:60]
        result.ms, result.note = {mode: None for mode in MODES}, f"unavailable: {first_line}"
    finally:
        # free this case's tensors before the next one
        gc.collect()
        torch.cuda.empty_cache()
    return result


def _check_and_time(result: Result, dtype, cfg) -> None:
    from triton.testing import do_bench

    case, backend = result.case, result.backend
    fn = _attention(backend, case.causal)
    q, k, v = _inputs(case, dtype)
    dout = torch.randn_like(q)  # [B, H, T, D]
    if backend in SDPA and case.n_kv_heads != case.n_heads:
        try:
            fn(q, k, v)
        # this torch's backend has no native GQA: give it full K/V heads
        except RuntimeError:
            q, k, v = _inputs(case, dtype, n_kv_heads=case.n_heads)
            result.note = "K/V heads repeated"
    if backend in OURS:
        want = _sdpa_reference(q, k, v, dout, case.causal)
        result.max_rel_err = _max_rel_err(_grads(fn, q, k, v, dout), want)
        del want
    out = fn(q, k, v)
    timed = {
        "fwd": lambda: fn(q, k, v),
        "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout),
    }
    for mode in MODES:
        result.ms[mode] = do_bench(timed[mode], warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")


def environment() -> dict:
    """What a README table of these numbers must name: date, GPU, torch, Triton."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version() or "not installed",
    }


TRITON_MISSING = 'Triton is not installed (pip install -e ".[triton]")'


def triton_version() -> str | None:
    """Triton's version, or None when it cannot be imported (the rows that need it are then left out)."""
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


def run(cfg) -> int:
    if not torch.cuda.is_available():
        raise GptkitError(
            "gptkit bench attention needs a CUDA GPU and none is visible; run it on a GPU machine"
        )
    # every backend is timed with triton's do_bench
    if triton_version() is None:
        raise GptkitError(f"gptkit bench attention times every backend with triton.testing: {TRITON_MISSING}")
    from gptkit_kernels import interpreting

    if interpreting():
        raise GptkitError(
            "TRITON_INTERPRET=1 would time the CPU interpreter; unset it to benchmark the GPU kernels"
        )
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"bench.dtype={cfg.dtype!r} must be one of {', '.join(DTYPES)}")
    unknown = sorted(set(cfg.backends) - set(BACKENDS))
    if unknown:
        raise ConfigError(f"unknown bench.backends {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    dtype = getattr(torch, DTYPES[cfg.dtype])
    cases = _cases(cfg)
    # SDPA first: the baseline
    backends = sorted(cfg.backends, key=lambda b: (b not in SDPA, BACKENDS.index(b)))

    env = environment()
    print(
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}: {len(cases)} "
        f"configurations x {len(backends)} backends, {cfg.dtype}, B*T = {cfg.tokens}; TFLOP/s (fwd "
        f"4*B*H*T^2*D, halved when causal; bwd 2.5x fwd)",
        flush=True,
    )
    print(header(), flush=True)
    results: list[Result] = []
    for case in cases:
        for backend in backends:
            r = _measure(case, backend, dtype, cfg)
            results.append(r)
            print(row(r, results, cfg.check_tol), flush=True)
            if cfg.out:
                _write(cfg.out, env, results)
    failed = [r for r in results if r.max_rel_err is not None and not r.max_rel_err <= cfg.check_tol]
    if cfg.out:
        print(f"wrote {cfg.out}", flush=True)
    if failed:
        print(
            f"{len(failed)} configuration(s) failed the check against SDPA (tolerance {cfg.check_tol})",
            flush=True,
        )
        return 1
    return 0


def _write(path, env: dict, results: list[Result]) -> None:
    atomic_write_text(path, json.dumps({**env, "results": [r.to_dict() for r in results]}, indent=2))


_COLUMNS = (
    ("T", 6),
    ("B", 4),
    ("hd", 4),
    ("heads", 6),
    ("causal", 6),
    ("backend", 26),
    ("fwd", 7),
    ("bwd", 7),
    ("fwd+bwd", 8),
    ("vs best sdpa", 12),
    ("check vs sdpa", 13),
)


def header() -> str:
    return "  ".join(f"{name:>{w}}" if name != "backend" else f"{name:<{w}}" for name, w in _COLUMNS)


def row(r: Result, results: list[Result], check_tol: float) -> str:
    """One printed line: TFLOP/s per mode, fwd+bwd speed against the fastest SDPA backend measured for the
    same configuration so far, and the check (ours)."""
    c = r.case

    def cell(mode: str) -> str:
        x = r.tflops(mode)
        return f"{x:.1f}" if x is not None else ("oom" if r.note == "oom" else "n/a")

    sdpa = [s.tflops("fwd+bwd") for s in results if s.case == c and s.backend in SDPA and s.tflops("fwd+bwd")]
    ratio = ""
    if r.backend not in SDPA and sdpa and r.tflops("fwd+bwd") is not None:
        ratio = f"{r.tflops('fwd+bwd') / max(sdpa):.2f}x"
    check = ""
    if r.max_rel_err is not None:
        check = f"{'ok' if r.max_rel_err <= check_tol else 'FAIL'} {r.max_rel_err:.1e}"
    backend = r.backend + (f" ({r.note})" if r.note and r.note != "oom" else "")
    cells = (
        c.T,
        c.batch,
        c.head_dim,
        f"{c.n_heads}/{c.n_kv_heads}",
        "yes" if c.causal else "no",
        backend[:26],
        cell("fwd"),
        cell("bwd"),
        cell("fwd+bwd"),
        ratio,
        check,
    )
    return "  ".join(
        f"{v!s:>{w}}" if name != "backend" else f"{v!s:<{w}}" for (name, w), v in zip(_COLUMNS, cells)
    )
