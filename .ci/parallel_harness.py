"""What the tensor-parallel checks against one process share (.ci/tensor_parallel.py,
.ci/context_tensor_parallel.py, .ci/expert_tensor_parallel.py): the tiny float64 models, the seeded batches,
the initial weights every rank loads, one rank's start on gloo and the spawn of the ranks; for their CLI
check the corpus, the tiny `gptkit train` overrides, the run's metrics and gptkit's entry point on more CPU
processes than cores.

Not a check itself: each script imports it as a sibling (`python .ci/<script>.py` puts .ci/ first on
sys.path, and the ranks mp.spawn and Lightning start run the same script).
"""

import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]

LLAMA = dict(
    vocab_size=67,
    max_seq_len=16,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_model=32,
    d_ff=48,
    position="rope",
    mlp="swiglu",
    norm="rmsnorm",
    bias=False,
    tie_embeddings=False,
    dropout=0.0,
    attention="sdpa",
)
GPT2 = dict(
    LLAMA,
    n_kv_heads=4,
    d_ff=64,
    position="learned",
    mlp="gelu",
    norm="layernorm",
    bias=True,
    tie_embeddings=True,
)
# rows and tokens of a batch (batches)
B, T = 4, 16


def float64_one_thread() -> None:
    """The process settings of the reference and of every rank: one thread, float64 by default."""
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)


def batches(steps: int, vocab: int) -> list[torch.Tensor]:
    """`steps` batches of B rows of T + 1 tokens (inputs, targets one token on), the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (B, T + 1), generator=g) for _ in range(steps)]


def initial_models(cfg_dicts: list[dict], tmp: str) -> list:
    """Model i seeded with i, its weights saved as tmp/init{i}.pt for the ranks (initial_model)."""
    from gptkit.model import GPT, ModelConfig

    models = []
    for i, cfg_dict in enumerate(cfg_dicts):
        torch.manual_seed(i)
        model = GPT(ModelConfig.from_dict(cfg_dict)).train()
        torch.save(model.state_dict(), os.path.join(tmp, f"init{i}.pt"))
        models.append(model)
    return models


def initial_model(cfg_dict: dict, tmp: str, i: int):
    """On a rank: model i with the weights initial_models saved, in training mode."""
    from gptkit.model import GPT, ModelConfig

    state = torch.load(os.path.join(tmp, f"init{i}.pt"))
    return GPT.from_state(ModelConfig.from_dict(cfg_dict), state).train()


def start_rank(rank: int, world: int, port: int) -> None:
    """One rank of `world` on gloo at 127.0.0.1:port, one thread, float64."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    float64_one_thread()
    dist.init_process_group("gloo", rank=rank, world_size=world)


def spawn(worker, world: int, *args) -> None:
    """worker(rank, world, port, *args) on `world` processes, port a free one (each ended by end_rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(end_rank, args=(worker, world, port, *args), nprocs=world)


def end_rank(rank: int, worker, *args) -> None:
    """mp.spawn's target: worker(rank, *args), then the process ends without the interpreter's teardown (an
    exception in worker still reaches mp.spawn as one). A rank's gloo group outlives destroy_process_group
    (DTensor's sharding caches keep its mesh): left to the teardown, its threads ended a rank with "terminate
    called without an active exception", SIGABRT, after the rank's work was done: ~1 run in 10 of
    tests/evaluation/test_eval_tasks.py's lockstep check (rank 0), and expert_tensor_parallel.py's rank 3 in
    CI (2026-12-06). Workers meet at a barrier before they end: rank 0 hosts the store the others may still
    need."""
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the CLI checks --------------------------------------------------------------------------------------
def shakespeare(n_chars: int = 20_000) -> str:
    """The tests' built-in corpus (tests/conftest.py)."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import shakespeare as text

    return text(n_chars)


def cli_env(**more: str) -> dict[str, str]:
    """The environment of a `gptkit` subprocess: one thread, no verb inherited from this process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **more)
    env.pop("GPTKIT_VERB", None)
    return env


def tiny_train(model: str, steps: int, val_every: int, runs: str | Path, name: str) -> list[str]:
    """`gptkit train`'s arguments for a tiny fp32 run on the CPU with a char tokenizer on data=files (the
    paths and the rest are the caller's): `steps` steps logged each, validated every `val_every`, a
    checkpoint at the end."""
    return [
        "train", f"model={model}", "model.n_layers=2", "model.d_model=32", "model.n_heads=4",
        "model.n_kv_heads=2", "model.max_seq_len=32", "tokenizer=char", "data=files", "data.val_fraction=0.1",
        f"trainer.max_steps={steps}", f"trainer.val_every={val_every}", "trainer.val_windows=4",
        f"trainer.checkpoint_every={steps}", "trainer.log_every=1", "trainer.progress=false",
        "trainer.accelerator=cpu", "trainer.precision=32-true", "optim.warmup_steps=2", f"runs_dir={runs}",
        f"name={name}",
    ]  # fmt: skip


def run_gptkit(argv: list[str], env: dict[str, str]) -> str:
    """Run `argv` (a gptkit command line) in the repository; its stdout, or exit with its stderr's tail."""
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO)
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} ... failed:\n{r.stderr[-3000:]}")
    return r.stdout


def metrics(run: Path) -> list[dict[str, str]]:
    """The rows of a run's metrics.csv."""
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def gptkit_with_cores(args: list[str] | None, cores: int) -> int:
    """gptkit's CLI with os.cpu_count() at least `cores`: `train` refuses more CPU processes than cores, and
    these checks run 4 or 8 on a 2-core box on purpose (equality, not speed)."""
    found = os.cpu_count() or 1
    os.cpu_count = lambda: max(found, cores)
    from gptkit.cli import main

    return main(args) or 0
