"""`gptkit bench serve`: `gptkit serve` under 1, 4 and 16 concurrent clients against the same requests served
one at a time, and against transformers' continuous batching on the same weights.

A run folder is written to a temporary folder (a conf/model preset, random init, and a word-level tokenizer
of exactly vocab_size tokens "w0 w1 ...", so every id decodes); `gptkit serve` runs it in a subprocess on a
free port. Each request is a prompt of random token ids (lengths drawn from bench.prompt_tokens) and
bench.new_tokens greedy tokens (ignore_eos: exactly that many), streamed. For each number of clients, that
many client tasks (asyncio + httpx in this process) take the requests in turn; per row:

    aggregate tokens/s   completion tokens of every request / the wall time from the first send to the last
                         [DONE]
    TTFT p50/p95/p99     time to first token: send -> the first chunk holding text
    TPOT p50/p95         time per output token after the first, per request: (last - first) / (tokens - 1)

Then, in this process with the server stopped: gptkit.inference.generate_many (the same engine without HTTP,
every request at once), gptkit's generate() one request at a time (`gptkit sample`'s loop), and
transformers' continuous batching (model.generate_batch, every request at once) on the model as
gptkit.hf.to_transformers builds it (the export's weights), where the installed transformers has it.
bench.device=cuda puts the server and every side on the GPU (.ci/gpu-check's bench-serve step).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from rich.table import Table

from gptkit.bench.decode import _console, build_model
from gptkit.bench.serve_peers import (
    PeerServer,
    discover,
    percentile,
    pinned,
    same_answers,
    server_cpus,
    shared_prefix_prompts,
    vocab_chars,
)
from gptkit.errors import ConfigError, GptkitError
from gptkit.extras import require
from gptkit.hf import to_transformers
from gptkit.inference.batcher import SamplingParams, generate_many
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.precision import torch_dtype
from gptkit.runs import write_run_folder
from gptkit.threads import set_threads

EOS = "<|endoftext|>"
# the side of `gptkit serve prefix_cache=false` (the shared-prefix workload, beside the cache on)
CACHE_OFF = "gptkit serve prefix_cache=false"
# a server that is not up in this long has hung
START_S = 300


def bench_tokenizer(vocab_size: int):
    """gptkit's char tokenizer of vocab_size ids: vocab_size - 1 single characters (serve_peers.vocab_chars),
    then the end-of-text token. A prompt's text is its ids on every server, and the GGUF export takes it."""
    from gptkit.tokenizer import char_tokenizer

    return char_tokenizer(vocab_chars(vocab_size - 1), [EOS])


def load_line() -> str:
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


class Server:
    """`gptkit serve` in a subprocess on a free port."""

    def __init__(
        self,
        run_dir: Path,
        threads: int | None,
        max_batch: int,
        max_queue: int,
        device: str,
        dtype: str,
        *options: str,
        cpus: frozenset[int] | None = None,
    ) -> None:
        args = [
            sys.executable,
            "-m",
            "gptkit",
            "serve",
            f"run={run_dir}",
            "port=0",
            f"max_batch={max_batch}",
            f"max_queue={max_queue}",
            "access_log=false",
            f"device={device}",
            f"dtype={dtype}",
        ]
        if threads:
            args.append(f"threads={threads}")
        args += options
        env = dict(os.environ)
        env.pop("GPTKIT_VERB", None)
        env.pop("GPTKIT_API_KEY", None)
        self.proc = subprocess.Popen(
            pinned(args, cpus), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True).start()
        give_up = time.monotonic() + START_S
        while not any("listening on" in x for x in self.lines):
            if self.proc.poll() is not None or time.monotonic() > give_up:
                self.stop()
                raise GptkitError(f"gptkit serve did not start: {''.join(self.err)[-500:]}")
            time.sleep(0.1)
        self.url = next(x for x in self.lines if "listening on" in x).split()[2]

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _one(client, body: dict) -> dict:
    """Send one streaming request; its timings and token count."""
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    text: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise GptkitError(f"the server answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", []):
                if c.get("text"):
                    text.append(c["text"])
                    last = time.perf_counter()
                    first = first if first is not None else last
    answer = "".join(text)
    # no usage chunk (llama-cpp-python's stream): one character is one token of the bench's vocabulary
    return {"sent": t0, "first": first, "last": last, "tokens": tokens or len(answer), "text": answer}


async def _clients(url: str, bodies: list[dict], clients: int) -> tuple[list[dict], float]:
    import httpx

    queue = list(range(len(bodies)))
    results: list[dict] = [{} for _ in bodies]
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=START_S, limits=limits) as client:

        async def worker():
            while queue:
                i = queue.pop(0)
                results[i] = await _one(client, bodies[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return results, wall


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (its threads, and its child processes alive now) so far."""
    import psutil

    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def http_row(url: str, bodies: list[dict], clients: int, pid: int) -> dict:
    cpu0 = cpu_seconds(pid)
    results, wall = asyncio.run(_clients(url, bodies, clients))
    cpu = cpu_seconds(pid) - cpu0
    tokens = sum(r["tokens"] for r in results)
    ttft = [(r["first"] - r["sent"]) * 1e3 for r in results if r["first"] is not None]
    tpot = [
        (r["last"] - r["first"]) / (r["tokens"] - 1) * 1e3
        for r in results
        if r["first"] is not None and r["tokens"] > 1
    ]
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "server_cpu_s": cpu,
        "tokens_per_cpu_s": tokens / cpu,
        "cpu_ms_per_token": cpu / tokens * 1e3,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p95": percentile(ttft, 95),
        "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50),
        "tpot_ms_p95": percentile(tpot, 95),
        "answers": [r["text"] for r in results],
    }


def in_process(side: str, fn) -> dict:
    """A row of this process's own work: fn() -> tokens, timed on the wall and on this process's CPU."""
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = fn()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "side": side,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "cpu_s": cpu,
        "tokens_per_cpu_s": tokens / cpu,
    }


def transformers_side(model, prompts: list[list[int]], new_tokens: int, cb_config: dict):
    """A function timing transformers' generate_batch (continuous batching) on the same weights, and the
    greedy answers of its last call; None where the installed transformers has no generate_batch."""
    w = model.tok_emb.weight
    hf_model = to_transformers(model).to(device=w.device, dtype=w.dtype)
    if not hasattr(hf_model, "generate_batch"):
        return None, None
    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0, bos_token_id=None
    )
    kwargs = {}
    if cb_config:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**cb_config)
    answers: list[list[int]] = []

    def batch() -> int:
        with torch.inference_mode():
            out = hf_model.generate_batch(prompts, generation_config=gen, **kwargs)
        answers[:] = [list(o.generated_tokens) for o in out.values()]
        return sum(len(a) for a in answers)

    # warm-up: nothing compiles on the CPU, but the paged cache is sized and allocated
    with torch.inference_mode():
        hf_model.generate_batch(prompts[:2], generation_config=gen, **kwargs)
    return batch, answers


def kv_cache(url: str) -> dict:
    """The server's /health kv_cache (its prefix cache's counters)."""
    import httpx

    return httpx.get(f"{url}/health", timeout=START_S).json()["kv_cache"]


def cache_ratio(rounds: dict[str, list[dict]], label: str, answers: dict) -> dict:
    """The shared-prefix workload's rounds with the prefix cache on and off: each round's ratio on / off
    (tokens/s, tokens per CPU s), their median and range."""
    on, off = rounds[f"gptkit serve, {label}"], rounds[f"{CACHE_OFF}, {label}"]
    rate = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(on, off)]
    cpu = [a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"] for a, b in zip(on, off)]
    return {
        "tokens_per_s_ratio": statistics.median(rate),
        "tokens_per_s_ratio_min": min(rate),
        "tokens_per_s_ratio_max": max(rate),
        "tokens_per_cpu_s_ratio": statistics.median(cpu),
        "ttft_ms_p50_on": statistics.median(r["ttft_ms_p50"] for r in on),
        "ttft_ms_p50_off": statistics.median(r["ttft_ms_p50"] for r in off),
        "prefix_hit_rate": statistics.median(r["prefix_hit_rate"] for r in on),
        "same_greedy_answers": same_answers(answers[("gptkit serve", label)], answers[(CACHE_OFF, label)]),
    }


def median_row(rows: list[dict]) -> dict:
    """One row from the repeats: the median of every figure (and the range of tokens/s)."""
    out = {k: v for k, v in rows[0].items() if k != "answers"}
    for key, value in out.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in rows)
    out["tokens_per_s_min"] = min(r["tokens_per_s"] for r in rows)
    out["tokens_per_s_max"] = max(r["tokens_per_s"] for r in rows)
    return out


def run(cfg) -> int:
    device, dtype = str(cfg.device), str(cfg.dtype)
    if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
        raise ConfigError(f"bench.device={device}: use cpu, or cuda (cuda:<n>) where torch sees a GPU")
    clients = [int(c) for c in cfg.clients]
    if not clients or any(c < 1 for c in clients):
        raise ConfigError(f"bench.clients={list(cfg.clients)} must list positive numbers")
    repeats = int(cfg.repeats)
    if repeats < 1:
        raise ConfigError(f"bench.repeats={cfg.repeats} must be >= 1")
    low, high = (int(x) for x in cfg.prompt_tokens)
    new_tokens, n_requests = int(cfg.new_tokens), int(cfg.requests)
    set_threads(cfg.threads, "bench.threads")
    cpus = server_cpus(cfg.get("cpus"))
    # null: the preset's value
    spec = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if v is not None}
    model = build_model(spec).to(device=device, dtype=torch_dtype(dtype))
    vocab = model.cfg.vocab_size
    if high + new_tokens > model.cfg.max_seq_len:
        raise ConfigError(
            f"bench.prompt_tokens up to {high} + bench.new_tokens={new_tokens} exceed the model's context "
            f"({model.cfg.max_seq_len})"
        )
    if cfg.hf:
        require("transformers", "bench.hf=true (bench.hf=false measures without it) needs")
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(
            0, vocab - 1, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n_requests)
    ]
    chars = vocab_chars(vocab - 1)
    shared = int(cfg.shared_prefix_tokens or 0)
    if shared and shared + high + new_tokens > model.cfg.max_seq_len:
        raise ConfigError(
            f"bench.shared_prefix_tokens={shared} + prompts up to {high} + {new_tokens} new tokens exceed "
            f"the model's context ({model.cfg.max_seq_len})"
        )

    def bodies_of(ids: list[list[int]]) -> list[dict]:
        return [
            {
                "prompt": "".join(chars[t] for t in p),
                "max_tokens": new_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for p in ids
        ]

    # (label, clients, bodies, shared prefix tokens): each number of clients on the prompts, then the
    # shared-prefix workload
    workloads = [(f"{c} client{'s' if c > 1 else ''}", c, bodies_of(prompts), 0) for c in clients]
    if shared:
        prefixed = shared_prefix_prompts(shared, prompts, vocab - 1)
        c = max(clients)
        workloads.append((f"shared {shared}-token prefix, {c} clients", c, bodies_of(prefixed), shared))
    con = _console()
    started = time.strftime("%Y-%m-%d %H:%M")
    results: dict = {
        "date": started,
        "model": spec,
        "params": model.num_parameters(),
        "requests": n_requests,
        "prompt_tokens": [low, high],
        "new_tokens": new_tokens,
        "threads": cfg.threads,
        "cpus": sorted(cpus) if cpus is not None else None,
        "device": device,
        "dtype": dtype,
        "max_batch": int(cfg.max_batch),
        "repeats": repeats,
        "load_before": load_line(),
        "rows": [],
    }
    con.print(f"[dim]{started}, {results['load_before']}, {os.cpu_count()} cores[/dim]")
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    engine_out: list = []

    def engine() -> int:
        engine_out[:] = generate_many(model, prompts, params, max_batch=int(cfg.max_batch))
        return sum(o.sampled for o in engine_out)

    def one_at_a_time() -> int:
        opts = SampleOptions(max_new_tokens=new_tokens, temperature=0)
        return sum(len(generate(model, p, opts).tokens[0]) for p in prompts)

    hf_batch, hf_answers = None, None
    if cfg.hf:
        hf_config = OmegaConf.to_container(cfg.hf_config, resolve=True) or {}
        hf_batch, hf_answers = transformers_side(model, prompts, new_tokens, hf_config)
        if hf_batch is None:
            results["transformers"] = "the installed transformers has no generate_batch (continuous batching)"
        else:
            results["transformers_config"] = hf_config
    rounds: dict[str, list[dict]] = {}
    # the last round's answers of each HTTP row, by (server, workload)
    answers: dict[tuple[str, str], list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="gptkit-bench-serve-") as tmp:
        run_dir = write_run_folder(
            Path(tmp) / "run", {"tokenizer": {"eos_token": EOS}}, model, bench_tokenizer(vocab)
        )

        def export(fmt: str, *extra: str) -> Path:
            out = Path(tmp) / f"export-{fmt}"
            args = [sys.executable, "-m", "gptkit", "export", f"run={run_dir}", f"out={out}", f"format={fmt}"]
            done = subprocess.run([*args, *extra], capture_output=True, text=True)
            if done.returncode:
                raise GptkitError(f"gptkit export format={fmt} failed: {done.stderr.strip()[-300:]}")
            return out

        peers = discover(
            [str(x) for x in cfg.peers or []],
            gguf=lambda: export("gguf", f"dtype={cfg.gguf_dtype}") / "model.gguf",
            hf=lambda: export("hf"),
            threads=cfg.threads,
            context=model.cfg.max_seq_len,
            eos_id=vocab - 1,
            vllm=str(cfg.get("vllm") or "vllm"),
            dtype=dtype,
        )
        for peer in peers:
            if peer.skip:
                con.print(f"{peer.name}: skipped, {peer.skip}")
                results.setdefault("peers_skipped", {})[peer.name] = peer.skip
        # every server sits idle (no CPU) while another one, or this process, is timed
        servers: list[tuple[str, object, dict]] = []
        try:
            queue = max(64, n_requests)
            server = Server(run_dir, cfg.threads, int(cfg.max_batch), queue, device, dtype, cpus=cpus)
            servers.append(("gptkit serve", server, {"ignore_eos": True}))
            if shared:
                # the same server with its prefix cache off, on the shared-prefix workload only
                off = Server(
                    run_dir,
                    cfg.threads,
                    int(cfg.max_batch),
                    queue,
                    device,
                    dtype,
                    "prefix_cache=false",
                    cpus=cpus,
                )
                servers.append((CACHE_OFF, off, {"ignore_eos": True}))
            for peer in peers:
                if not peer.skip:
                    servers.append((peer.name, PeerServer(peer, START_S, cfg.threads, cpus), peer.body))
            for name, srv, extra in servers:
                # warm-up: the first requests pay for lazy set-up
                warm = [
                    {**b, **extra} for b in workloads[-1 if name == CACHE_OFF else 0][2][: min(4, n_requests)]
                ]
                http_row(srv.url, warm, len(warm), srv.proc.pid)
            # round after round, every side once: a change in the machine's load reaches them all
            for r in range(repeats):
                for label, c, bodies, prefix in workloads:
                    for name, srv, extra in servers:
                        if name == CACHE_OFF and not prefix:
                            continue
                        kv0 = kv_cache(srv.url) if name == "gptkit serve" and prefix else None
                        row = http_row(srv.url, [{**b, **extra} for b in bodies], c, srv.proc.pid)
                        row["side"], row["prefix_tokens"] = f"{name}, {label}", prefix
                        if kv0 is not None:
                            kv1 = kv_cache(srv.url)
                            looked = kv1["prefix_lookup_tokens"] - kv0["prefix_lookup_tokens"]
                            hits = kv1["prefix_hit_tokens"] - kv0["prefix_hit_tokens"]
                            row["prefix_hit_rate"] = hits / looked if looked else 0.0
                        answers[(name, label)] = row.pop("answers")
                        rounds.setdefault(row["side"], []).append(row)
                sides = [
                    ("gptkit engine, no HTTP (generate_many)", engine),
                    ("gptkit generate(), one at a time (gptkit sample's loop)", one_at_a_time),
                ]
                if hf_batch is not None:
                    sides.append(("transformers generate_batch (continuous batching)", hf_batch))
                for side, fn in sides:
                    rounds.setdefault(side, []).append(in_process(side, fn))
                con.print(
                    f"[dim]round {r + 1}/{repeats}: "
                    + ", ".join(f"{k}: {v[-1]['tokens_per_s']:,.0f}" for k, v in rounds.items())
                    + f" tokens/s; {load_line()}[/dim]"
                )
        finally:
            for _, srv, _ in servers:
                srv.stop()
    results["rows"] = [median_row(v) for v in rounds.values()]
    for row in results["rows"]:
        name, _, label = row["side"].partition(", ")
        if (name, label) in answers and name != "gptkit serve":
            row["same_greedy_answers"] = same_answers(
                answers[("gptkit serve", label)], answers[(name, label)]
            )
    hf = next((r for r in results["rows"] if r["side"].startswith("transformers generate_batch")), None)
    if hf is not None:
        ours = [o.choices[0].tokens for o in engine_out]
        same = sum(a == b for a, b in zip(ours, hf_answers))
        hf["same_greedy_answers"] = f"{same}/{len(ours)}"
    results["load_after"] = load_line()

    one = results["rows"][0]
    pinned_to = f", every server on CPUs {sorted(cpus)}" if cpus is not None else ""
    t = Table(
        title=f"gptkit bench serve: {n_requests} requests, prompts of {low}-{high} tokens + {new_tokens} "
        f"greedy tokens each, {spec.get('preset')} ({model.num_parameters() / 1e6:.1f}M parameters), "
        f"{device} {dtype}, threads={cfg.threads}{pinned_to}, max_batch={cfg.max_batch}; median of {repeats} "
        "rounds (min-max)"
    )
    cols = (
        "side",
        "tokens/s",
        "vs 1 client",
        "CPU ms per token",
        "TTFT p50 / p99 ms",
        "TPOT p50 / p95 ms",
        "same answers",
    )
    for col in cols:
        t.add_column(col, justify="left" if col == "side" else "right")
    for r in results["rows"]:
        ttft = f"{r['ttft_ms_p50']:,.0f} / {r['ttft_ms_p99']:,.0f}" if "ttft_ms_p50" in r else "-"
        tpot = f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p95']:.1f}" if "tpot_ms_p50" in r else "-"
        r["vs_one_client"] = r["tokens_per_s"] / one["tokens_per_s"]
        rate = f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f})"
        cpu = f"{1e3 / r['tokens_per_cpu_s']:.2f}"
        same = r.get("same_greedy_answers", "-")
        t.add_row(r["side"], rate, f"{r['vs_one_client']:.2f}x", cpu, ttft, tpot, same)
    con.print(t)
    ours = [r for r in results["rows"] if r["side"].startswith("gptkit serve") and not r["prefix_tokens"]]
    best = max(ours, key=lambda r: r["clients"])
    line = f"{best['side']}: {best['vs_one_client']:.2f}x the aggregate of {one['side']} (one at a time)"
    if hf is not None:
        line += (
            f"; {best['tokens_per_s'] / hf['tokens_per_s']:.2f}x transformers' continuous batching in "
            f"tokens/s, {best['tokens_per_cpu_s'] / hf['tokens_per_cpu_s']:.2f}x in tokens per CPU s "
            f"(same greedy answers as gptkit's engine: {hf['same_greedy_answers']})"
        )
    elif isinstance(results.get("transformers"), str):
        line += f"; {results['transformers']}"
    con.print(line)
    by_side = {r["side"]: r for r in results["rows"]}
    for r in results["rows"]:
        name, _, label = r["side"].partition(", ")
        mine = by_side.get(f"gptkit serve, {label}")
        if "clients" in r and name not in ("gptkit serve", CACHE_OFF) and mine is not None:
            con.print(
                f"gptkit serve vs {name}, {label}: {mine['tokens_per_s'] / r['tokens_per_s']:.2f}x its "
                f"tokens/s, TTFT p50 {mine['ttft_ms_p50']:,.0f} vs {r['ttft_ms_p50']:,.0f} ms, CPU per token "
                f"{mine['cpu_ms_per_token']:.2f} vs {r['cpu_ms_per_token']:.2f} ms, same greedy answers "
                f"{r['same_greedy_answers']}"
            )
    if shared:
        results["prefix_cache"] = cache_ratio(rounds, workloads[-1][0], answers)
        pc = results["prefix_cache"]
        con.print(
            f"{workloads[-1][0]}: prefix cache on vs off (prefix_cache=false) "
            f"{pc['tokens_per_s_ratio']:.2f}x tokens/s (per round {pc['tokens_per_s_ratio_min']:.2f}-"
            f"{pc['tokens_per_s_ratio_max']:.2f}), {pc['tokens_per_cpu_s_ratio']:.2f}x tokens per CPU s, "
            f"TTFT p50 {pc['ttft_ms_p50_on']:,.0f} vs {pc['ttft_ms_p50_off']:,.0f} ms, prefix hit rate "
            f"{pc['prefix_hit_rate']:.2f}, same greedy answers {pc['same_greedy_answers']}"
        )
    con.print(
        "[dim]CPU ms per token: the server process's CPU time (and its children's) for the HTTP rows (their "
        "clients run in this process), this process's for the others: steadier than tokens/s on a busy "
        "machine[/dim]"
    )
    con.print(f"[dim]{results['load_after']} at the end[/dim]")
    if cfg.out:
        from gptkit.fsio import atomic_write_text

        atomic_write_text(Path(str(cfg.out)), json.dumps(results, indent=2))
        print(f"results: {cfg.out}")
    return 0
