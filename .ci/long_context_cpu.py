"""A long context on the CPU: 5 local : 1 global layers against all-global at the same shape, step time and
memory of training and of decoding.

    nice -n 10 python .ci/long_context_cpu.py [--seq 4096] [--window 512] [--steps 6] [--rounds 3]

The model is gemma3-tiny (6 layers, d_model 128, GQA 4:1, head_dim 32) at model.max_seq_len=--seq with a
byte vocabulary (256: the logits do not drown the attention), model.attention=sdpa, fp32: once with its
preset's layer_types (five local layers of --window, one global), once with every layer global. Each variant
runs in its own process (its peak RSS is its own), the two alternating for --rounds rounds; each process
(--threads torch threads, 1 by default):
  train   --steps AdamW steps of one row of --seq random tokens after one warm-up step: the median ms per
          step (wall, and the process's CPU time: steadier on a shared machine), the peak of the tensor
          storage alive during one step (gptkit.bench.kernels.PeakMemory: the weights and the optimizer state
          excluded) and the process's peak RSS;
  decode  a prefill of --seq - 64 tokens, then 64 one-token steps through the KV cache (the rolling cache for
          the local layers): ms per token (wall, CPU) and the cache's bytes.
The medians over the rounds print per variant, with their ratio, the date, the machine's load and the
analytic attention FLOPs per token (gptkit.accounting).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("5:1 local:global", "all global")


def model_config(seq: int, window: int, variant: str):
    import yaml

    from gptkit.conf_tree import conf_dir
    from gptkit.model import ModelConfig

    d = yaml.safe_load((conf_dir() / "model" / "gemma3-tiny.yaml").read_text())
    d |= {"max_seq_len": seq, "vocab_size": 256, "sliding_window": window, "attention": "sdpa"}
    if variant == "all global":
        d["layer_types"] = ["global"] * d["n_layers"]
    return ModelConfig.from_dict(d)


def worker(args) -> dict:
    import torch

    from gptkit.bench.kernels import PeakMemory
    from gptkit.model import GPT, KVCache

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = model_config(args.seq, args.window, args.variant)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (1, args.seq))  # [1, T]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x, x).loss.backward()
        opt.step()

    # warm-up; then the storage one step allocates (weights, grads of the last step, AdamW state excluded)
    step()
    opt.zero_grad(set_to_none=True)
    with PeakMemory() as mem:
        model(x, x).loss.backward()
    opt.step()
    times, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    model.eval()
    prompt, new = x[:, : args.seq - 64], 64
    with torch.inference_mode():
        cache = KVCache(cfg, 1)
        logits = model(prompt, cache=cache, logits_to_keep=1).logits
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(new):
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            logits = model(nxt, cache=cache, logits_to_keep=1).logits
        decode_ms = (time.perf_counter() - t0) * 1e3 / new
        decode_cpu_ms = (time.process_time() - c0) * 1e3 / new
    return {
        "step_ms": statistics.median(times),
        "step_cpu_ms": statistics.median(cpu),
        "step_peak_tensor_bytes": mem.peak,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "decode_ms_per_token": decode_ms,
        "decode_cpu_ms_per_token": decode_cpu_ms,
        "kv_cache_bytes": cache.nbytes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(worker(args)))
        return
    from gptkit import accounting as acc

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, load average {load} (before), {args.threads} thread(s): "
        f"gemma3-tiny, max_seq_len {args.seq}, window {args.window}, vocab 256, fp32, model.attention=sdpa",
        flush=True,
    )
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            cmd = [sys.executable, __file__, "--variant", v]
            cmd += [f"--{k}={getattr(args, k)}" for k in ("seq", "window", "steps", "threads")]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[v].append(json.loads(out.strip().splitlines()[-1]))
            print(f"  round {r + 1} {v}: {runs[v][-1]}", flush=True)
    med = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in runs.items()}
    flops = {v: acc.flops_per_token(model_config(args.seq, args.window, v)) for v in VARIANTS}
    rows = (
        ("train step (ms, wall)", "step_ms", 1.0),
        ("train step (ms, CPU time)", "step_cpu_ms", 1.0),
        ("train step: peak tensor storage (MiB)", "step_peak_tensor_bytes", 2**-20),
        ("process peak RSS (MiB)", "peak_rss_bytes", 2**-20),
        ("decode at context ~{} (ms/token, wall)".format(args.seq - 32), "decode_ms_per_token", 1.0),
        ("decode at context ~{} (ms/token, CPU)".format(args.seq - 32), "decode_cpu_ms_per_token", 1.0),
        ("KV cache at context {} (MiB)".format(args.seq), "kv_cache_bytes", 2**-20),
    )
    a, b = VARIANTS
    print(f"{'':42s} {a:>18s} {b:>12s}  ratio")
    for name, key, unit in rows:
        x, y = med[a][key] * unit, med[b][key] * unit
        print(f"{name:42s} {x:18.2f} {y:12.2f}  {x / y:.2f}")
    fa, fb = (flops[v].attention_forward_causal for v in VARIANTS)
    print(
        f"{'attention FLOPs per token, causal (MFLOP)':42s} {fa / 1e6:18.2f} {fb / 1e6:12.2f}  {fa / fb:.2f}"
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average {load} (after)")


if __name__ == "__main__":
    main()
