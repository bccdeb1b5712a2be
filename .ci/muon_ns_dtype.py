"""Time MuonWithAdamW.step on llama-tiny (one CPU thread) with Newton-Schulz in bfloat16 and in float32,
alternating, on the same gradients: the cost of optim.muon.ns_dtype=float32.

    python .ci/muon_ns_dtype.py [REPEATS]            (default 15)
"""

import statistics
import sys
import time

import torch

from gptkit.conf_tree import compose
from gptkit.model import GPT, ModelConfig
from gptkit.training.optim import build_optimizer

LLAMA_TINY = dict(
    vocab_size=256,
    max_seq_len=128,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    d_model=128,
    d_ff=352,
    position="rope",
    mlp="swiglu",
    norm="rmsnorm",
    bias=False,
    tie_embeddings=False,
)


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    torch.set_num_threads(1)
    optimizers = {}
    for ns_dtype in ("bfloat16", "float32"):
        torch.manual_seed(0)
        model = GPT(ModelConfig(**LLAMA_TINY))
        x = torch.randint(0, 256, (4, 128))  # [B, T]
        model(x, torch.roll(x, -1, 1)).loss.backward()
        cfg = compose("train", ["optim=muon", f"optim.muon.ns_dtype={ns_dtype}"]).optim
        optimizers[ns_dtype] = build_optimizer(model, cfg)
    seconds = {k: [] for k in optimizers}
    for _ in range(repeats):
        for ns_dtype, opt in optimizers.items():
            t = time.perf_counter()
            opt.step()
            seconds[ns_dtype].append(time.perf_counter() - t)
    bf16, fp32 = (statistics.median(seconds[k]) for k in ("bfloat16", "float32"))
    print(
        f"llama-tiny MuonWithAdamW.step, 1 thread, median of {repeats}: bfloat16 Newton-Schulz "
        f"{bf16 * 1e3:.1f} ms, float32 {fp32 * 1e3:.1f} ms: {fp32 / bf16:.2f}x"
    )


if __name__ == "__main__":
    main()
