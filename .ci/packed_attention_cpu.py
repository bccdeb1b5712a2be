"""Packed documents on the CPU: what SDPA costs with the documents' dense mask against plain causal attention.

    python .ci/packed_attention_cpu.py [B T n_heads n_kv_heads head_dim]     (default: experiment=sft-tiny's)

Times forward + backward of F.scaled_dot_product_attention, one thread, in interleaved rounds (the median
of each), for: is_causal without a mask (no document boundaries: the floor), the bool mask of
Documents.mask(), and the additive fp32 mask gptkit builds once per forward (Documents.mask(q.dtype)).
Documents of ~37 tokens (the sft-tiny conversations). Prints the kernel SDPA picks and each time.
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from gptkit.model.documents import Documents


def main(B=16, T=128, H=4, Hkv=2, D=32, rounds=15, reps=10) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    docs = Documents(torch.cumsum(torch.rand(B, T) < 1 / 37, dim=1))  # [B, T] doc ids
    q = torch.randn(B, H, T, D, requires_grad=True)
    k, v = (torch.randn(B, Hkv, T, D, requires_grad=True) for _ in range(2))
    cases = {
        "causal, no mask": (None, True),
        "bool mask": (docs.mask(), False),
        "additive fp32 mask": (docs.mask(torch.float32), False),
    }
    with torch.profiler.profile() as prof:
        F.scaled_dot_product_attention(q, k, v, attn_mask=cases["additive fp32 mask"][0], enable_gqa=True)
    kernels = sorted({e.key for e in prof.key_averages() if "attention_" in e.key or "flash" in e.key})
    print(f"B={B} T={T} n_heads={H} n_kv_heads={Hkv} head_dim={D}; masked SDPA runs {', '.join(kernels)}")
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (mask, causal) in cases.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True
                )
                out.sum().backward()
            times[name].append((time.perf_counter() - t0) / reps)
    base = statistics.median(times["causal, no mask"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:20s} {m * 1e3:7.2f} ms forward+backward  ({m / base:.2f}x causal)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
