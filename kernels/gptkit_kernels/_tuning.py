"""Autotuning or pinned launch configurations, shared by every kernel in this package.

On a GPU the kernels are autotuned over a small space per head dim (or row width); the timings are
cached on disk across runs where Triton supports it (cache_results, Triton >= 3.4: in
TRITON_CACHE_DIR, default ~/.triton/cache). GPTKIT_KERNELS_AUTOTUNE=0 pins one configuration per
kernel instead: no tuning runs, so a test suite compiles each kernel once per shape class.
"""

from __future__ import annotations

import inspect
import os

import triton

ENV = "GPTKIT_KERNELS_AUTOTUNE"


def tuning() -> bool:
    """False when GPTKIT_KERNELS_AUTOTUNE=0: launch the pinned configuration instead of autotuning."""
    return os.environ.get(ENV, "1") != "0"


def pinned(table: dict[int, tuple], width: int) -> tuple:
    """The entry of `table` (keyed by the largest width it covers) for this padded width."""
    return next(table[w] for w in sorted(table) if width <= w)


def _short_bench(fn, quantiles):
    # the tuner needs a ranking, not a precise time: 5 ms warm-up, 25 ms measured per config
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


_PARAMS = inspect.signature(triton.autotune).parameters
_EXTRA = {k: v for k, v in (("cache_results", True), ("do_bench", _short_bench)) if k in _PARAMS}


def autotuned(kernel, space: dict[int, list[tuple]], key: list[str], width_arg: str = "BLOCK_D"):
    """`kernel` wrapped in triton.autotune over the union of `space`'s configs
    (BLOCK_M, BLOCK_N, num_warps, num_stages), pruned at launch to the row of the padded width."""
    union = sorted({c for row in space.values() for c in row})
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in union]

    def prune(configs, named_args, **kwargs):
        row = pinned(space, {**named_args, **kwargs}[width_arg])
        return [
            c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in row
        ]

    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": prune}, **_EXTRA)(kernel)
