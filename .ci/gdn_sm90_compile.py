"""Compile the gated delta rule's Triton kernels (kernels/gptkit_kernels/gated_delta.py) for sm_90 (H100/H200)
offline, no GPU: triton.compile with Triton's own ptxas, then each kernel's registers and stack per thread
(cuobjdump -res-usage of the cubin) and the shared memory it asks for at launch (the compiled metadata).

    python .ci/gdn_sm90_compile.py [--shape CHUNK,D_K,D_V ...] [--no-spill]

Default shapes: chunks of 16 and 64 with 16- and 128-wide heads (64 and 128: Qwen3-Next's), chunk 32 with
64-wide heads, chunk 64 with 40 (padded heads). Each kernel gets the constexprs the autograd wrapper launches
it with (_blocks, BR) and its num_warps and num_stages (LAUNCH). Exits 1 when a kernel asks for more shared
memory than an sm_90 block may use (232,448 B), or with --no-spill when one spills to the stack; prints one
line and exits 0 when Triton has no ptxas here (nothing to check). Not a timing: nothing runs.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from gptkit_kernels import gated_delta as gd  # noqa: E402

SHARED_LIMIT = 232_448  # the most dynamic shared memory a block may use on sm_90 (227 KiB)
SHAPES = ((16, 16, 16), (16, 128, 128), (64, 16, 16), (64, 128, 128), (32, 64, 64), (64, 40, 40))
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def kernels():
    """The module's Triton kernels, in the order the wrapper launches them."""
    return [getattr(gd, n) for n in gd.LAUNCH]


def compile_one(kernel, chunk: int, K: int, V: int) -> dict:
    BK, BV, BC = gd._blocks(K, V, None)
    values = {"K": K, "V": V, "BT": chunk, "BK": BK, "BV": BV, "BC": BC, "BR": gd.BR}
    values.update(HAS_S0=True, HAS_DSF=True)  # a state carried in, a gradient of the final state
    signature, constexprs = {}, {}
    for arg in kernel.arg_names:
        if arg.endswith("_ptr"):
            signature[arg] = "*i32" if arg == "seg_ptr" else "*fp32"
        elif arg in values:
            signature[arg], constexprs[arg] = "constexpr", values[arg]
        else:
            signature[arg] = "i32"  # T, H, N
    warps, stages = gd.LAUNCH[kernel.__name__]
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        sys.exit(f"error: cuobjdump gave no resource usage for {kernel.__name__}: {usage.strip()[:200]}")
    regs, stack = map(int, found.groups())
    return {
        "warps": warps,
        "stages": stages,
        "regs": regs,
        "stack": stack,
        "smem": compiled.metadata.shared,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="CHUNK,D_K,D_V (repeatable)")
    parser.add_argument("--no-spill", action="store_true", help="fail when a kernel spills to the stack")
    args = parser.parse_args()
    if not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists():
        print(f"skipped: no ptxas/cuobjdump under {BIN} (this Triton cannot compile for sm_90 here)")
        return 0
    try:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
        assert all(len(s) == 3 for s in shapes)
    except (ValueError, AssertionError):
        print("error: --shape takes CHUNK,D_K,D_V (three integers)", file=sys.stderr)
        return 2
    for reason in filter(None, (gd.unsupported(*shape) for shape in shapes)):
        print(f"error: the kernel cannot take {reason}", file=sys.stderr)
        return 2
    print(f"triton {triton.__version__}, sm_90, ptxas {BIN / 'ptxas'}")
    print("| chunk | d_k | d_v | kernel | warps / stages | registers | stack B | shared B |")
    print("|---|---|---|---|---|---|---|---|")
    bad = []
    for chunk, K, V in shapes:
        for kernel in kernels():
            r = compile_one(kernel, chunk, K, V)
            name = kernel.__name__
            cells = (
                chunk,
                K,
                V,
                name,
                f"{r['warps']} / {r['stages']}",
                r["regs"],
                f"{r['stack']:,}",
                f"{r['smem']:,}",
            )
            print("| " + " | ".join(map(str, cells)) + " |")
            if r["smem"] > SHARED_LIMIT:
                bad.append(f"{name} at chunk {chunk}, {K}x{V}: {r['smem']:,} B shared > {SHARED_LIMIT:,}")
            if args.no_spill and r["stack"] > 0:
                bad.append(f"{name} at chunk {chunk}, {K}x{V}: {r['stack']:,} B stack")
    for line in bad:
        print("FAIL:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
