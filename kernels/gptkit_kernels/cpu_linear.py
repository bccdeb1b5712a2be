"""A CPU fp32 linear map for the few rows a decode step feeds a layer: cpu_linear.c, compiled once per
machine with the system's C compiler and loaded with ctypes (no torch headers, no build step at install).

    available()                 None when the kernel runs here; else why not, in one line
    Packed(weight, bias=None)   W [N, K] laid out once: [ceil(N / 16), K, 16], 16 outputs side by side for
                                each input (pack()), the bias padded to whole blocks
    Packed(...)(x)              x [M, K] -> x @ W^T + bias, [M, N]
    Packed.int8(q, scale, bias) int8 values q [N, K] and a scale an output row, packed the same way (a quarter
                                of the bytes to stream): x @ (q * scale)^T + bias, summed in fp32
                                (quantize=int8's layer on the CPU, gptkit/quant_int8.py)
    Kept(max_bytes=None)        packed copies kept per layer or weight while their tensors are unchanged

Why: a decode step streams every weight from memory for 1-16 rows. torch's CPU kernels (oneDNN packed, MKL
on either layout) take the memory time plus the arithmetic time at 16 rows; this kernel prefetches the next
lines of each block so the two overlap (docs/kernels.md has the measurements). Each output is the bias plus
the sum over k of x[m, k] * w[n, k] with fused multiply-adds, in chunks of 64 inputs whose partial sums are
added up: fp32 results as far from the float64 map as F.linear's (within 4x, tested).

Where it runs: x86-64 with AVX-512 (torch.backends.cpu.get_cpu_capability() == "AVX512") and a C compiler
(`cc`, or $CC) that takes -mavx512f -fopenmp (its OpenMP is torch's own libgomp, already loaded); it is built
under $GPTKIT_CACHE/kernels (default ~/.cache/gptkit/kernels; about a second), named by a hash of its source,
flags and compiler, written atomically, and checked against F.linear once when loaded.
GPTKIT_CPU_LINEAR=0 turns it off (the callers then use torch's kernels).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

BLOCK = 16
_SOURCE = Path(__file__).with_name("cpu_linear.c")
_FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


def _cache_dir() -> Optional[Path]:
    """$GPTKIT_CACHE/kernels, else ~/.cache/gptkit/kernels (gptkit's cache); None when GPTKIT_CACHE names
    object storage (the kernel is then built in a private temporary folder)."""
    root = os.environ.get("GPTKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gptkit")
    return None if "://" in root else Path(root).expanduser() / "kernels"


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    """The shared library, compiled now unless the cache has it; OSError or CalledProcessError on failure.
    Where the cache cannot be written, it is built in a new private temporary folder (never a shared one
    another user could have filled)."""
    source = _SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), version.encode()])).hexdigest()[:16]
    name = f"cpu_linear-{key}.so"
    out_dir = _cache_dir()
    if out_dir is not None and (out_dir / name).is_file():
        return out_dir / name
    try:
        if out_dir is None:
            raise OSError("no local cache")
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".cpu_linear-", suffix=".so")
    except OSError:
        out_dir = Path(tempfile.mkdtemp(prefix="gptkit-kernels-"))
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".cpu_linear-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [cc, *_FLAGS, str(_SOURCE), "-o", tmp], check=True, capture_output=True, text=True, timeout=300
        )
        # another process may have built it meanwhile: either copy is the same
        os.replace(tmp, out_dir / name)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_dir / name


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Optional[tuple], Optional[str]]:
    """((the fp32 function, the int8 one), None), or (None, why not)."""
    if os.environ.get("GPTKIT_CPU_LINEAR", "1") == "0":
        return None, "turned off (GPTKIT_CPU_LINEAR=0)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the kernel is written for x86-64 with AVX-512, not {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        return None, f"this CPU runs torch's {capability} kernels, and the kernel needs AVX-512"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or $CC) to build it"
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except subprocess.CalledProcessError as exc:
        last = (exc.stderr or "").strip().splitlines()
        return None, f"{cc} could not build it: {last[-1] if last else exc}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"it could not be built or loaded: {exc}"
    fn = lib.gptkit_cpu_linear
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    fn.restype = None
    fn8 = lib.gptkit_cpu_linear_i8
    fn8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3 + [ctypes.c_int]
    fn8.restype = None
    # a wrong build (a compiler that mistranslates it) is found here, not in a model's answers
    g = torch.Generator().manual_seed(0)
    for rows, n, k in ((1, 37, 40), (13, 16, 9), (21, 50, 33)):
        x = torch.randn(rows, k, generator=g)
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        q, scale = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g)
        got = _run(fn, x, pack(w), _pad(b, n), n, 1)
        got8 = _run(fn8, x, pack(q), _pad(b, n), n, 1, _pad(scale, n))
        if not torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4) or not torch.allclose(
            got8, F.linear(x, q.float() * scale[:, None], b), rtol=1e-4, atol=1e-3
        ):
            return None, f"the build {lib._name} computes wrong results (delete it to rebuild)"
    return (fn, fn8), None


def available() -> Optional[str]:
    """None when the kernel runs on this machine; else why not (one line)."""
    return _load()[1]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (fp32) -> [ceil(N / 16), K, 16]: block b holds outputs 16b..16b+15, the last block zero
    padded (one pass over the weight)."""
    w = weight.detach()
    n, k = w.shape
    full = n // BLOCK
    blocks = -(-n // BLOCK)
    packed = w.new_empty(blocks, k, BLOCK)
    packed[:full].copy_(w[: full * BLOCK].view(full, BLOCK, k).transpose(1, 2))
    if blocks > full:
        tail = packed[full]  # [K, 16]
        tail.zero_()
        tail[:, : n - full * BLOCK].copy_(w[full * BLOCK :].t())
    return packed


def _pad(v: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    """A bias or scale [n] as fp32 padded with zeros to whole blocks; None stays None."""
    if v is None:
        return None
    padded = torch.zeros(-(-n // BLOCK) * BLOCK)
    padded[:n] = v.detach().float()
    return padded


def _run(fn, x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int, threads: int,
         scale: Optional[torch.Tensor] = None):  # fmt: skip
    y = x.new_empty(x.shape[0], n)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    head = (ptr(x), packed.data_ptr()) + (() if scale is None else (scale.data_ptr(),))
    fn(*head, ptr(bias), y.data_ptr(), x.shape[0], x.shape[1], n, threads)
    return y


class Kept:
    """Packed copies kept per owner (weakly: while the owner lives) and reused while the tensors they were
    packed from are the same, unchanged (data pointer and torch's version counter: an optimizer step,
    load_state_dict or any in-place write repacks; an inference tensor has no counter and is packed anew each
    time). max_bytes: the most packed weight bytes kept at once; past it get() returns None."""

    def __init__(self, max_bytes: Optional[int] = None) -> None:
        self.max_bytes = max_bytes
        self._hits: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def get(self, owner, sources: tuple, make: Callable[[], "Packed"], nbytes: int = 0) -> Optional["Packed"]:
        """The owner's packed copy of `sources` (tensors or None), made by make() when there is none yet or
        they changed; None where it would pass max_bytes (nbytes: what the new copy's weight takes)."""
        try:
            key = tuple(None if t is None else (t.data_ptr(), t._version) for t in sources)
        except RuntimeError:
            key = None
        hit = self._hits.get(owner)
        if key is not None and hit is not None and hit[0] == key:
            return hit[1]
        if self.max_bytes is not None:
            held = sum(p.weight.nbytes for o, (_, p) in self._hits.items() if o is not owner)
            if held + nbytes > self.max_bytes:
                return None
        packed = make()
        if key is not None:
            self._hits[owner] = (key, packed)
        return packed


class Packed:
    """A linear map laid out for the kernel: Packed(weight [N, K], bias [N] or None), fp32 on the CPU; then
    packed(x [M, K]) -> x @ W^T + bias [M, N] on torch's number of threads. The weight and bias are packed
    and checked once here, so a call checks only x (the decode step calls it for every layer).

    Packed.int8(q [N, K] int8, scale [N], bias): the same for the weight q * scale[:, None] (one scale an
    output row), streamed as int8: x @ q^T * scale + bias, the sums in fp32."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        fns, why = _load()
        if fns is None:
            raise RuntimeError(f"gptkit's CPU linear kernel is not available: {why}")
        if weight.dtype != torch.float32 or not weight.is_cpu or weight.dim() != 2:
            raise TypeError(f"cpu_linear takes an fp32 [N, K] weight on the CPU, not {weight.dtype} "
                            f"{tuple(weight.shape)} on {weight.device}")  # fmt: skip
        self.fn, self.scale = fns[0], None
        self.n, self.k = weight.shape
        self.weight = pack(weight)
        self.bias = _pad(bias, self.n)

    @classmethod
    def int8(cls, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "Packed":
        fns, why = _load()
        if fns is None:
            raise RuntimeError(f"gptkit's CPU linear kernel is not available: {why}")
        if q.dtype != torch.int8 or not q.is_cpu or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise TypeError(f"cpu_linear int8 takes int8 [N, K] values on the CPU and a scale [N], not "
                            f"{q.dtype} {tuple(q.shape)} on {q.device} and {tuple(scale.shape)}")  # fmt: skip
        self = cls.__new__(cls)
        self.fn = fns[1]
        self.n, self.k = q.shape
        self.weight = pack(q)
        self.bias, self.scale = _pad(bias, self.n), _pad(scale, self.n)
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(
                f"cpu_linear: x must be fp32 [M, {self.k}] on the CPU, not {x.dtype} {tuple(x.shape)}"
            )
        if not x.is_contiguous():
            x = x.contiguous()
        return _run(self.fn, x, self.weight, self.bias, self.n, torch.get_num_threads(), self.scale)
