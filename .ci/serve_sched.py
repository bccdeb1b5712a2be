"""Issue 53 items 1-3, measured: the serve engine's time to first token and tokens/s under 16 concurrent
clients, prompts prefilled alone one after another (one slot a sequence: the engine before paging) against
packed and chunked prefill under serve.max_step_tokens (paged), and a workload whose prompts share a system
prompt with the prefix cache off and on. In process (gptkit.inference.Engine, no HTTP), llama-tiny at a
context of 1024, random init, greedy, one torch thread, on the CPU with serve's decoding layout; every variant
on the same requests, in turn, `uptime` printed before and after. Per request: the time to its first token,
and the longest gap between two of its tokens (what a long prompt admitted beside it costs it).

    python .ci/serve_sched.py [--requests 48] [--new 32] [--rounds 3] [--only 0,4,5] [--cpu-clock]
                              [--mixed 16,600] [--mixed-step on|off|both] [--generate-many]

--mixed LO,HI: the mixed prompts' lengths (drawn uniformly in [LO, HI)); 8,48 with --new 64 is the shape of
`gptkit bench serve`'s default workload. The scheduler's order (issue 53 item 1) is measured against main's
by running this file under each tree in turn (PYTHONPATH=<tree>: the loop in docs/serve.md, "Scheduling").

--cpu-clock: the Batcher in this thread (no Engine, no client threads), 16 clients in a closed loop, every
time on the process's CPU clock (closed_loop): steady on a loaded machine.

--mixed-step on|off|both: the paged rows with the mixed step (a step's decodes and prompt chunks in one
forward, gptkit/inference/scheduler.py) on (the default), off (a decode forward, then a packed one), or each
row both ways, interleaved in the rounds (a before/after in one command).

--generate-many: instead, generate_many's throughput on a 56M Llama (d 512, 8 layers, 8 heads, 4 K/V heads,
d_ff 1376): 48 prompts of 8-48 random tokens, 64 greedy tokens each, max_batch 16, with the mixed step on and
off, interleaved over --rounds, in tokens per CPU second of this process (run it under OMP_NUM_THREADS=1
taskset -c <core>).

--step: instead, one decode step of n sequences of L tokens (16 x 550) over the paged pool (its blocks
scattered) against the slot cache (contiguous), interleaved, CPU ms a step (min-max over the rounds). It runs
on a tree from before the decode rows too (PYTHONPATH=<that tree>), for a before/after.
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


def mixed_step(batcher, on: bool) -> None:
    """The mixed step on or off (a tree before it has no such switch: on is then refused)."""
    paged = batcher.paged
    if paged is None:
        return
    if not hasattr(paged, "mixed"):
        if on:
            raise SystemExit("this tree has no mixed step: run it with --mixed-step off")
        return
    paged.mixed = paged.mixed and on


def run(model, prompts, new, paging, mixed=True):
    engine = Engine(model, max_batch=16, max_queue=256, layout_rows=16, paging=paging)
    mixed_step(engine.batcher, mixed)
    engine.start()
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
    line = (
        f"TTFT p50 {pct(ttft, 50):5.0f} p99 {pct(ttft, 99):5.0f} ms  longest gap between tokens p50 "
        f"{pct(stall, 50):4.0f} p99 {pct(stall, 99):4.0f} ms  {rate:4.0f} tokens/s  hit {hit}"
    )
    return pct(ttft, 50), line, (pct(ttft, 99), rate)


def decode_step(model, n: int, L: int, rounds: int) -> None:
    """CPU ms of one decode step, paged (blocks in a shuffled order) vs the slot cache, interleaved."""
    from gptkit.inference import block_pool as bp
    from gptkit.inference.decoding_layout import decoding_layout
    from gptkit.inference.slot_cache import SlotCache

    bs = 16
    per = -(-(L + n + 1) // bs)
    pool = bp.BlockPool(model.cfg, n * per, bs, torch.device("cpu"), torch.float32)
    slots = SlotCache(model.cfg, n, model.cfg.max_seq_len)
    for t in pool.k + pool.v + slots.k + slots.v:
        t.normal_()
    order = torch.randperm(pool.blocks, generator=torch.Generator().manual_seed(0)).tolist()
    pages = []
    for i in range(n):
        p = bp.Pages()
        p.table = order[i * per : (i + 1) * per]
        pages.append(p)
    # a tree before the decode rows: DecodeView(pool, pages) gathers the blocks each step
    rows = bp.DecodeRows(pool, n, model.cfg.max_seq_len) if hasattr(bp, "DecodeRows") else None
    tok = torch.randint(0, 1000, (n, 1), generator=torch.Generator().manual_seed(1))

    def paged():
        for i, p in enumerate(pages):
            p.computed = L + i
        view = bp.DecodeView(pool, pages) if rows is None else bp.DecodeView(pool, pages, rows)
        model(tok, cache=view, logits_to_keep=1)

    def contiguous():
        slots.lengths[:n] = [L + i for i in range(n)]
        model(tok, cache=slots.decode(n), logits_to_keep=1)

    got = {"paged": [], "slot cache": []}
    with torch.inference_mode(), decoding_layout(model, n):
        for f in (paged, contiguous, paged, contiguous):
            f()
        for _ in range(rounds):
            for name, f in (("paged", paged), ("slot cache", contiguous)):
                t = time.process_time()
                for _ in range(10):
                    f()
                got[name].append((time.process_time() - t) / 10 * 1e3)
    for name, xs in got.items():
        xs.sort()
        print(
            f"decode step, {n} x {L} tokens, {name:10s}: {xs[len(xs) // 2]:.2f} ms CPU "
            f"({xs[0]:.2f}-{xs[-1]:.2f})"
        )
    ratio = sorted(a / b for a, b in zip(got["paged"], got["slot cache"]))
    print(f"paged / slot cache: {ratio[len(ratio) // 2]:.2f}x ({ratio[0]:.2f}-{ratio[-1]:.2f}, per round)")


def closed_loop(model, prompts, new, paging, mixed=True):
    """The same requests through a Batcher in this thread, 16 clients in a closed loop (a request ends, its
    client's next one is queued before the next step), timed on this process's CPU clock: the figures do not
    move with the machine's load (a wall clock under 7 other helpers' work moved by up to 2x run to run)."""
    from gptkit.inference.batcher import Batcher, Job
    from gptkit.inference.decoding_layout import decoding_layout

    batcher = Batcher(model, max_batch=16, paging=paging)
    mixed_step(batcher, mixed)
    # and in steps (the load does not move them): steps between a request's arrival and its first token
    ttft, stall, tokens, waits = [], [], [0], []
    todo = iter(range(len(prompts)))

    def submit():
        i = next(todo, None)
        if i is None:
            return
        sent, seen, at = time.process_time(), [], batcher.steps

        def deliver(events):
            now = time.process_time()
            for e in events:
                if e.tokens:
                    if not seen:
                        waits.append(batcher.steps - at)
                    seen.append(now)
                    tokens[0] += len(e.tokens)
                if e.finish:
                    ttft.append((seen[0] - sent) * 1e3)
                    stall.append(max((b - a for a, b in zip(seen, seen[1:])), default=0.0) * 1e3)
                    submit()

        batcher.add(Job(prompts[i], SamplingParams(max_new_tokens=new, temperature=0.0), deliver))

    with decoding_layout(model, 16):
        for _ in range(16):
            submit()
        c0 = time.process_time()
        while batcher.busy:
            batcher.step()
        cpu = time.process_time() - c0
    kv = batcher.paged.stats() if batcher.paged is not None else {}
    hit = f"{kv['prefix_hit_rate']:.2f}" if kv else "-"
    line = (
        f"TTFT p50 {pct(ttft, 50):5.0f} p99 {pct(ttft, 99):5.0f} ms CPU ({pct(waits, 50)}, {pct(waits, 99)} "
        f"steps)  longest gap between tokens p50 {pct(stall, 50):4.0f} p99 {pct(stall, 99):4.0f} ms CPU  "
        f"{tokens[0] / cpu:4.0f} tokens per CPU s  {batcher.steps} steps  hit {hit}"
    )
    return pct(ttft, 50), line, (pct(ttft, 99), tokens[0] / cpu)


def generate_many_rate(rounds: int) -> None:
    """generate_many's tokens per CPU second on a 56M Llama, 16 rows, the mixed step on and off."""
    from gptkit.bench.serve import build_model as serve_model
    from gptkit.inference import scheduler
    from gptkit.inference.batcher import generate_many

    spec = dict(preset="llama-tiny", d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1376)
    model = serve_model(dict(spec, max_seq_len=512))
    g = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    prompts = [
        torch.randint(0, vocab, (int(torch.randint(8, 48, (1,), generator=g)),), generator=g).tolist()
        for _ in range(48)
    ]
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    init, state = scheduler.PagedSteps.__init__, {"on": True, "steps": 0}

    def switched(self, batcher, paging):
        init(self, batcher, paging)
        self.mixed = self.mixed and state["on"]
        state["batcher"] = batcher

    scheduler.PagedSteps.__init__ = switched
    got = {True: [], False: []}
    answers = {}
    with torch.inference_mode():
        generate_many(model, prompts[:16], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
        for _ in range(rounds):
            for on in (True, False):
                state["on"] = on
                t = time.process_time()
                out = generate_many(model, prompts, params, max_batch=16)
                cpu = time.process_time() - t
                tokens = sum(len(c.tokens) for r in out for c in r.choices)
                b = state["batcher"]
                got[on].append((tokens / cpu, b.steps, b.paged.mixed_steps if on else 0))
                answers[on] = [r.choices[0].tokens for r in out]
    scheduler.PagedSteps.__init__ = init
    for on in (True, False):
        rates = sorted(r for r, _, _ in got[on])
        _, steps, mixed = got[on][-1]
        name = "mixed step on " if on else "mixed step off"
        print(
            f"generate_many 48 x 64 tokens, 16 rows, {name}: {rates[len(rates) // 2]:.1f} tokens per CPU s "
            f"({rates[0]:.1f}-{rates[-1]:.1f})  {steps} steps, {mixed} mixed"
        )
    ratio = sorted(a[0] / b[0] for a, b in zip(got[True], got[False]))
    print(f"on / off: {ratio[len(ratio) // 2]:.3f}x ({ratio[0]:.3f}-{ratio[-1]:.3f}, per round)")
    print(f"same greedy tokens on and off: {answers[True] == answers[False]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mixed", default="16,600", help="the mixed prompts' lengths: LO,HI (HI excluded)")
    ap.add_argument("--only", default=None, help="the rows to run, by index (0-6), comma-separated")
    ap.add_argument("--mixed-step", choices=("on", "off", "both"), default="on")
    ap.add_argument("--generate-many", action="store_true", help="generate_many's tokens/CPU s, mixed on/off")
    ap.add_argument("--step", action="store_true", help="a decode step paged vs the slot cache, 16 x 550")
    ap.add_argument(
        "--cpu-clock", action="store_true", help="the Batcher in one thread, a closed loop, CPU clock"
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.generate_many:
        print(os.popen("uptime").read().strip())
        generate_many_rate(a.rounds)
        print(os.popen("uptime").read().strip())
        return
    model = build_model({"preset": "llama-tiny", "max_seq_len": 1024})
    if a.step:
        print(os.popen("uptime").read().strip())
        decode_step(model, 16, 550, max(a.rounds, 5))
        print(os.popen("uptime").read().strip())
        return
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    lo, hi = (int(x) for x in a.mixed.split(","))
    mixed = [
        torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
        for _ in range(a.requests)
    ]
    system = torch.randint(0, vocab, (400,), generator=g).tolist()
    shared = [system + torch.randint(0, vocab, (24,), generator=g).tolist() for _ in range(a.requests)]
    print(os.popen("uptime").read().strip())
    start = time.perf_counter()
    mix, sh = f"mixed prompts {lo}-{hi} tokens", "400-token shared prefix + 24"
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
    if a.only is not None:
        rows = [rows[int(i)] for i in a.only.split(",")]
    ways = {"on": [True], "off": [False], "both": [True, False]}[a.mixed_step]
    both = a.mixed_step == "both"
    rows = [
        (w, side + (f", mixed {'on' if on else 'off'}" if both and paging else ""), ps, paging, on)
        for w, side, ps, paging in rows
        for on in (ways if paging is not None else [True])
    ]
    got = {i: [] for i in range(len(rows))}
    with torch.inference_mode():
        # the rounds interleaved: each variant once per round; the round of the median TTFT p50 is shown
        for _ in range(a.rounds):
            for i, (_, _, ps, paging, on) in enumerate(rows):
                got[i].append((closed_loop if a.cpu_clock else run)(model, ps, a.new, paging, on))
    for i, (workload, side, _, _, _) in enumerate(rows):
        line = sorted(got[i], key=lambda r: r[0])[len(got[i]) // 2][1]
        print(f"{workload:29s} {side:37s} {line}", flush=True)
        if both and rows[i][4] and i + 1 < len(rows) and rows[i + 1][2:4] == rows[i][2:4]:
            # mixed on (this row) / off (the next), each round's pair: TTFT p99, tokens per second
            pairs = [(a[2][0] / b[2][0], a[2][1] / b[2][1]) for a, b in zip(got[i], got[i + 1])]
            p99 = ", ".join(f"{x:.2f}" for x, _ in pairs)
            rate = ", ".join(f"{y:.2f}" for _, y in pairs)
            print(f"{'':67s} on / off per round: TTFT p99 {p99}x; tokens per second {rate}x", flush=True)
    print(os.popen("uptime").read().strip())
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
