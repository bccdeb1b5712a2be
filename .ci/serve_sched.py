"""Issue 53 items 1-3, measured: the serve engine's time to first token and tokens/s under 16 concurrent
clients, prompts prefilled alone one after another (one slot a sequence: the engine before paging) against
packed and chunked prefill under serve.max_step_tokens (paged), and a workload whose prompts share a system
prompt with the prefix cache off and on. In process (gptkit.inference.Engine, no HTTP), llama-tiny at a
context of 1024, random init, greedy, one torch thread, on the CPU with serve's decoding layout; every variant
on the same requests, in turn, `uptime` printed before and after. Per request: the time to its first token,
and the longest gap between two of its tokens (what a long prompt admitted beside it costs it).

    python .ci/serve_sched.py [--requests 48] [--new 32] [--rounds 3]
"""

import argparse
import os
import threading
import time

import torch

from gptkit.bench.decode import build_model
from gptkit.inference.batcher import SamplingParams
from gptkit.inference.block_pool import Paging
from gptkit.inference.engine import Engine


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def run(model, prompts, new, paging):
    engine = Engine(model, max_batch=16, max_queue=256, layout_rows=16, paging=paging).start()
    ttft, stall, tokens, lock = [], [], [0], threading.Lock()
    jobs = iter(range(len(prompts)))

    def client():
        for i in iter(lambda: next(jobs, None), None):
            t0 = time.perf_counter()
            first, n, last, worst = None, 0, None, 0.0
            for e in engine.submit(prompts[i], SamplingParams(max_new_tokens=new, temperature=0.0)):
                now = time.perf_counter()
                if e.tokens and first is None:
                    first = now
                elif e.tokens:
                    worst = max(worst, now - last)
                last = now if e.tokens else last
                n += len(e.tokens)
            with lock:
                ttft.append((first - t0) * 1e3)
                stall.append(worst * 1e3)
                tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    load = engine.load()
    engine.stop()
    kv = load["kv_cache"]
    hit = f"{kv['prefix_hit_rate']:.2f}" if kv.get("paged", True) else "-"
    rate = tokens[0] / wall
    return pct(ttft, 50), (
        f"TTFT p50 {pct(ttft, 50):5.0f} p99 {pct(ttft, 99):5.0f} ms  longest gap between tokens p50 "
        f"{pct(stall, 50):4.0f} p99 {pct(stall, 99):4.0f} ms  {rate:4.0f} tokens/s  hit {hit}"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model({"preset": "llama-tiny", "max_seq_len": 1024})
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    mixed = [
        torch.randint(0, vocab, (int(torch.randint(16, 600, (1,), generator=g)),), generator=g).tolist()
        for _ in range(a.requests)
    ]
    system = torch.randint(0, vocab, (400,), generator=g).tolist()
    shared = [system + torch.randint(0, vocab, (24,), generator=g).tolist() for _ in range(a.requests)]
    print(os.popen("uptime").read().strip())
    start = time.perf_counter()
    mix, sh = "mixed prompts 16-600 tokens", "400-token shared prefix + 24"
    rows = [
        (mix, "prefill alone (slot cache)", mixed, None),
        *(
            (
                mix,
                f"packed+chunked, max_step_tokens={t}",
                mixed,
                Paging(max_step_tokens=t, prefix_cache=False),
            )
            for t in (512, 256, 128)
        ),
        (sh, "prefill alone (slot cache)", shared, None),
        (sh, "paged, prefix cache off", shared, Paging(prefix_cache=False)),
        (sh, "paged, prefix cache on", shared, Paging()),
    ]
    got = {i: [] for i in range(len(rows))}
    with torch.inference_mode():
        # the rounds interleaved: each variant once per round; the round of the median TTFT p50 is shown
        for _ in range(a.rounds):
            for i, (_, _, ps, paging) in enumerate(rows):
                got[i].append(run(model, ps, a.new, paging))
    for i, (workload, side, _, _) in enumerate(rows):
        line = sorted(got[i], key=lambda r: r[0])[len(got[i]) // 2][1]
        print(f"{workload:29s} {side:37s} {line}", flush=True)
    print(os.popen("uptime").read().strip())
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
