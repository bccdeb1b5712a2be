"""`gptkit bench attention`: our Triton FlashAttention against PyTorch SDPA's flash and cuDNN backends.

For every T in bench.seq_lens (batch = bench.tokens // T), head dim, causal or not, GQA ratio and sliding
window (bench.windows: null is full attention; W, causal only), and every backend in bench.backends (SDPA's
first, so that ours can be compared with the fastest):
  1. check (ours): output and dQ/dK/dV against SDPA flash, or for a window against gptkit's sdpa backend
     (torch's variable-length FlashAttention with its window on CUDA in fp16/bf16; query chunks elsewhere)
     (max |diff| / max |reference| <= bench.check_tol);
  2. time forward, backward and forward+backward with triton.testing.do_bench (median, after warm-up).
Backends: triton (our FA2 kernels, the default implementation), triton-tma (the Hopper TMA kernels),
triton-tma-ws (the same, warp-specialized forward), sdpa-flash, sdpa-cudnn (SDPA's own kernels: no window),
sdpa (gptkit's sdpa backend, what model.attention=sdpa runs), eager.
TFLOP/s use the usual convention: forward 4*B*H*T*keys*D (keys: T, T/2 when causal, W - W^2/2T with a
window), backward 2.5x forward. Each row prints as soon as it is measured (and bench.out is rewritten), so a
run cut short keeps what it measured; a windowed row also says which fraction of the causal forward's tiles
our kernel computes. Our kernels' autotuning results are cached on disk by Triton (>= 3.4) across runs. Eager
attention may run out of memory at large T: that cell reads "oom".

bench.device=cuda (the default) needs a CUDA GPU. bench.device=cpu times sdpa and eager with a wall-clock
median (fp32, load average in the header) and checks triton in the Triton interpreter (TRITON_INTERPRET=1),
which it does not time: the CPU rows of a sliding window.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gptkit.errors import ConfigError, GptkitError
from gptkit.extras import pip
from gptkit.fsio import atomic_write_text

MODES = ("fwd", "bwd", "fwd+bwd")
BACKENDS = ("triton", "triton-tma", "triton-tma-ws", "sdpa-flash", "sdpa-cudnn", "sdpa", "eager")
# backend -> flash_attention impl
OURS = {"triton": "fa2", "triton-tma": "tma", "triton-tma-ws": "tma-ws"}
# backend -> SDPBackend member
SDPA = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
# the baselines a row's speed is compared with: SDPA's kernels and gptkit's sdpa backend
BASELINES = (*SDPA, "sdpa")
# bench.device=cpu: what it runs
CPU_BACKENDS = ("sdpa", "eager", "triton")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEVICE = "cuda"


@dataclass
class Case:
    T: int
    batch: int
    head_dim: int
    n_heads: int
    n_kv_heads: int
    causal: bool
    # None: full attention; W: a causal sliding window of W positions
    window: int | None = None

    def keys(self) -> float:
        """The mean keys a query sees: T, T/2 causal, w - w^2 / 2T with a window w = min(W, T)."""
        if self.window is not None:
            w = min(self.window, self.T)
            return w - w * w / (2 * self.T)
        return self.T / 2 if self.causal else float(self.T)

    def fwd_flops(self) -> float:
        return 4.0 * self.batch * self.n_heads * self.T * self.keys() * self.head_dim

    def flops(self, mode: str) -> float:
        return self.fwd_flops() * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


@dataclass
class Result:
    case: Case
    backend: str
    # mode -> median ms; None: see note
    ms: dict[str, float | None] = field(default_factory=dict)
    note: str = ""
    # ours only: the check against SDPA flash (a window: gptkit's sdpa backend)
    max_rel_err: float | None = None
    # ours with a window: the forward's tiles as a fraction of the full causal forward's (flash.forward_tiles)
    tiles: float | None = None

    def tflops(self, mode: str) -> float | None:
        ms = self.ms.get(mode)
        return None if ms is None else self.case.flops(mode) / (ms * 1e-3) / 1e12

    def to_dict(self) -> dict:
        d = {**asdict(self.case), "backend": self.backend, "note": self.note, "max_rel_err": self.max_rel_err}
        d["tiles"] = self.tiles
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
                    for window in cfg.windows:
                        if window is not None and (not isinstance(window, int) or window < 1):
                            raise ConfigError(f"bench.windows holds {window!r}: each must be null or W >= 1")
                        # a sliding window is causal
                        if window is not None and not causal:
                            continue
                        cases.append(
                            Case(
                                T, cfg.tokens // T, head_dim, n_heads, n_heads // group, bool(causal), window
                            )
                        )
    return cases


def _attention(backend: str, causal: bool, window: int | None = None):
    """(q, k, v) -> out for one backend. sdpa-* must be called inside their sdpa_kernel(...)."""
    from gptkit.model.attention import eager_attention, sdpa_attention

    if backend in OURS:
        from gptkit_kernels import flash_attention

        return lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window, impl=OURS[backend])
    if backend in SDPA:
        if window is not None:
            raise RuntimeError("SDPA's own kernels have no sliding window (gptkit's sdpa backend has)")
        return lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
        )
    if backend == "sdpa":
        return lambda q, k, v: sdpa_attention(q, k, v, causal=causal, window=window)[0]
    return lambda q, k, v: eager_attention(q, k, v, causal=causal, window=window)[0]


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


def _sdpa_reference(q, k, v, dout, causal, window=None):
    """SDPA flash output and grads; K/V repeated per query head (autograd sums their grads back). A window:
    gptkit's sdpa backend (torch's variable-length FlashAttention with its window on CUDA in fp16/bf16)."""
    if window is not None:
        return _grads(_attention("sdpa", causal, window), q, k, v, dout)
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


def _cpu_bench(fn, warmup: float, rep: float, return_mode: str = "median") -> float:
    """Median wall ms of fn() on the CPU: warm-up for `warmup` ms, then runs for about `rep` ms (3 runs at
    least)."""
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < warmup:
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start) * 1e3 < rep:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _check_and_time(result: Result, dtype, cfg) -> None:
    case, backend = result.case, result.backend
    cpu = cfg.get("device") == "cpu"
    if cpu:
        do_bench = _cpu_bench
    else:
        from triton.testing import do_bench
    fn = _attention(backend, case.causal, case.window)
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
        want = _sdpa_reference(q, k, v, dout, case.causal, case.window)
        result.max_rel_err = _max_rel_err(_grads(fn, q, k, v, dout), want)
        del want
        if case.window is not None:
            from gptkit_kernels.flash import _INTERPRET_BLOCKS, forward_tiles, interpreting

            bm, bn = _INTERPRET_BLOCKS["fwd"] if interpreting() else (128, 64)
            windowed = forward_tiles(case.T, bm, bn, True, None, case.window)
            result.tiles = windowed / forward_tiles(case.T, bm, bn, True)
        # the interpreter's times say nothing of the kernel's
        if cpu:
            result.ms, result.note = {mode: None for mode in MODES}, "interpreter, not timed"
            return
    out = fn(q, k, v)
    timed = {
        "fwd": lambda: fn(q, k, v),
        "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout),
    }
    for mode in MODES:
        result.ms[mode] = do_bench(timed[mode], warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")


def environment(cpu: bool = False) -> dict:
    """What a README table of these numbers must name: date, GPU (or the CPU's threads and load), torch,
    Triton."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    if cpu:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        gpu = f"CPU, {torch.get_num_threads()} threads, load average {load}"
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version() or "not installed",
    }


# what the rows left out say (gptkit.extras has the install command)
TRITON_MISSING = f"triton is not installed: {pip('triton')}"


def triton_version() -> str | None:
    """Triton's version, or None when it cannot be imported (the rows that need it are then left out)."""
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


def _check_device(cfg) -> None:
    """bench.device, and what it needs: a GPU and Triton outside the interpreter; on the CPU its backends
    only, the triton row in the interpreter."""
    if cfg.device not in ("cuda", "cpu"):
        raise ConfigError(f"bench.device={cfg.device!r} must be cuda or cpu")
    if cfg.device == "cpu":
        other = sorted(set(cfg.backends) - set(CPU_BACKENDS))
        if other:
            raise ConfigError(
                f"bench.device=cpu runs bench.backends {', '.join(CPU_BACKENDS)}, not {', '.join(other)}"
            )
        if "triton" in cfg.backends:
            if triton_version() is None:
                raise GptkitError(f"the triton row needs Triton, and {TRITON_MISSING}")
            from gptkit_kernels import interpreting

            if not interpreting():
                raise GptkitError(
                    "bench.device=cpu checks the triton row in the interpreter: set TRITON_INTERPRET=1 (or "
                    "leave triton out of bench.backends)"
                )
        return
    if not torch.cuda.is_available():
        raise GptkitError(
            "gptkit bench attention needs a CUDA GPU and none is visible; run it on a GPU machine (or "
            "bench.device=cpu for the CPU rows)"
        )
    # every backend is timed with triton's do_bench
    if triton_version() is None:
        raise GptkitError(
            f"gptkit bench attention times every backend with triton.testing, and {TRITON_MISSING}"
        )
    from gptkit_kernels import interpreting

    if interpreting():
        raise GptkitError(
            "TRITON_INTERPRET=1 would time the CPU interpreter; unset it to benchmark the GPU kernels"
        )


def run(cfg) -> int:
    global DEVICE
    _check_device(cfg)
    # where the inputs are made (restored after: a process may run both)
    previous, DEVICE = DEVICE, cfg.device
    try:
        return _run(cfg)
    finally:
        DEVICE = previous


def _run(cfg) -> int:
    cpu = cfg.device == "cpu"
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"bench.dtype={cfg.dtype!r} must be one of {', '.join(DTYPES)}")
    unknown = sorted(set(cfg.backends) - set(BACKENDS))
    if unknown:
        raise ConfigError(f"unknown bench.backends {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    dtype = getattr(torch, DTYPES[cfg.dtype])
    cases = _cases(cfg)
    # SDPA first: the baseline
    backends = sorted(cfg.backends, key=lambda b: (b not in BASELINES, BACKENDS.index(b)))

    env = environment(cpu)
    print(
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}: {len(cases)} "
        f"configurations x {len(backends)} backends, {cfg.dtype}, B*T = {cfg.tokens}; TFLOP/s (fwd "
        f"4*B*H*T*keys*D: keys T, T/2 causal, W - W^2/2T in a window; bwd 2.5x fwd)"
        + ("; on the CPU: ms" if cpu else ""),
        flush=True,
    )
    print(header(), flush=True)
    results: list[Result] = []
    for case in cases:
        for backend in backends:
            r = _measure(case, backend, dtype, cfg)
            results.append(r)
            print(row(r, results, cfg.check_tol, cpu), flush=True)
            if cfg.out:
                _write(cfg.out, env, results)
    for line in window_summary(results):
        print(line, flush=True)
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


def window_summary(results: list[Result]) -> list[str]:
    """One line per windowed row that has its full causal twin (same T, shape, backend): the forward+backward
    ms of both and their ratio (for ours, which is checked but not timed on the CPU, its tile fraction)."""
    lines = []
    for r in results:
        if r.case.window is None:
            continue
        full = next(
            (
                s
                for s in results
                if s.backend == r.backend and s.case == dataclasses.replace(r.case, window=None)
            ),
            None,
        )
        a, b = r.ms.get("fwd+bwd"), full.ms.get("fwd+bwd") if full else None
        tiles = f"; forward tiles {r.tiles:.0%} of the causal forward's" if r.tiles is not None else ""
        if a is not None and b is not None:
            lines.append(
                f"window {r.case.window} at T={r.case.T} ({r.backend}): fwd+bwd {a:.2f} ms vs {b:.2f} ms "
                f"full causal: speed-up {b / a:.2f}x{tiles}"
            )
        elif tiles:
            lines.append(f"window {r.case.window} at T={r.case.T} ({r.backend}){tiles}")
    return lines


_COLUMNS = (
    ("T", 6),
    ("B", 4),
    ("hd", 4),
    ("heads", 6),
    ("causal", 6),
    ("window", 6),
    ("backend", 26),
    ("fwd", 7),
    ("bwd", 7),
    ("fwd+bwd", 8),
    ("vs best sdpa", 12),
    ("check vs sdpa", 13),
)


def header() -> str:
    return "  ".join(f"{name:>{w}}" if name != "backend" else f"{name:<{w}}" for name, w in _COLUMNS)


def row(r: Result, results: list[Result], check_tol: float, cpu: bool = False) -> str:
    """One printed line: TFLOP/s per mode, fwd+bwd speed against the fastest SDPA backend measured for the
    same configuration so far, and the check (ours)."""
    c = r.case

    def cell(mode: str) -> str:
        # the CPU's: ms (its TFLOP/s round to 0.0)
        x = r.ms.get(mode) if cpu else r.tflops(mode)
        if x is None:
            return "oom" if r.note == "oom" else "n/a"
        return f"{x:.2f}" if cpu else f"{x:.1f}"

    sdpa = [
        s.tflops("fwd+bwd") for s in results if s.case == c and s.backend in BASELINES and s.tflops("fwd+bwd")
    ]
    ratio = ""
    if r.backend not in BASELINES and sdpa and r.tflops("fwd+bwd") is not None:
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
        c.window or "-",
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
