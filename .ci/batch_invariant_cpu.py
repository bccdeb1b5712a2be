"""grpo.batch_invariant on the CPU: what the batch-invariant forwards cost against torch's, and the mismatch
each leaves between the sampler's log-probs and the trainer's.

    python .ci/batch_invariant_cpu.py [threads]      (default 1)

experiment=grpo-tiny's shapes: experiment=sft-tiny's model (3 layers, d_model 128, GQA 4:2, SwiGLU, RoPE; a
byte vocabulary with chatml's 3 special tokens, 259), 8 prompts of 20-33 tokens x 8 completions of 10 new
tokens (the rows of one step: [64, <= 43]). Times, in interleaved rounds (the median of each), with the mode
off and on: the sampler (sample_groups: prefill and 10 decode steps, tokens/s of new tokens), the trainer's
forward (target_logps over the rows, no grad) and its forward + backward (tokens/s of the rows' tokens).
Prints max |sampler - trainer| of the step's completion tokens for each, in fp32 and under bf16 autocast.
"""

import statistics
import sys
import time

import torch

from gptkit.inference.rollouts import RolloutOptions, sample_groups, sample_key
from gptkit.model import GPT, ModelConfig
from gptkit.model.batch_invariant import batch_invariant
from gptkit.training.objectives.base import target_logps
from gptkit.training.objectives.grpo_rows import completion_rows, sampled_rows


def main(threads: int = 1, rounds: int = 5) -> None:
    start = time.perf_counter()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=259,
        max_seq_len=128,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        d_model=128,
        d_ff=384,
        position="rope",
        mlp="swiglu",
        norm="rmsnorm",
    )
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 259, (int(n),), generator=g).tolist() for n in torch.randint(20, 34, (8,))]
    keys = [[sample_key(0, 0, p, r) for r in range(8)] for p in range(8)]
    opts = RolloutOptions(10, 1.0)
    times: dict[tuple[str, bool], list[float]] = {}
    diffs, counts = {}, {}
    for _ in range(rounds):
        for on in (False, True):
            with batch_invariant(model, on):
                t = time.perf_counter()
                groups = sample_groups(model, prompts, keys, opts, [10] * 8)
                times.setdefault(("sampler", on), []).append(time.perf_counter() - t)
                x, y = completion_rows(prompts, [c.tokens for gr in groups for c in gr], 0)
                t = time.perf_counter()
                with torch.no_grad():
                    lp = target_logps(model, x, y)
                times.setdefault(("forward", on), []).append(time.perf_counter() - t)
                t = time.perf_counter()
                target_logps(model, x, y).sum().backward()
                times.setdefault(("forward + backward", on), []).append(time.perf_counter() - t)
                model.zero_grad(set_to_none=True)
            mask = y != -100
            diffs[on] = float(((lp - sampled_rows(prompts, groups, y.shape)).abs() * mask).max())
            counts[("sampler", on)] = int(mask.sum())
            counts[("forward", on)] = counts[("forward + backward", on)] = int(x.numel())
    print(f"torch {torch.__version__}, {threads} thread(s), {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'':22} {'torch (tokens/s)':>18} {'batch-invariant':>18} {'ratio':>7}")
    for what in ("sampler", "forward", "forward + backward"):
        plain, inv = (counts[(what, on)] / statistics.median(times[(what, on)]) for on in (False, True))
        print(f"{what:22} {plain:18,.0f} {inv:18,.0f} {inv / plain:7.2f}")
    print(f"max |sampler - trainer| log-prob: torch {diffs[False]:.3g}, batch-invariant {diffs[True]:.3g}")
    # the same step under bf16 autocast (precision=bf16-mixed), once each
    for on in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), batch_invariant(model, on):
            groups = sample_groups(model, prompts, keys, opts, [10] * 8)
            x, y = completion_rows(prompts, [c.tokens for gr in groups for c in gr], 0)
            lp = target_logps(model, x, y)
        diffs[on] = float(((lp - sampled_rows(prompts, groups, y.shape)).abs() * (y != -100)).max())
    print(f"... under bf16 autocast: torch {diffs[False]:.3g}, batch-invariant {diffs[True]:.3g}")
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
