"""Multi-process training on CPU (gloo), through the CLI as a user runs it: DDP and FSDP2 follow the
single-process loss trajectory, resume crosses world sizes and strategies, sharded checkpoints
consolidate and load in one process, and bad set-ups fail in one line instead of hanging.

Every multi-process run is its own session (process group) and is killed as a group on timeout, so
no rank outlives its test.
"""

import csv
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import HANG_S, HYBRID, REPO, module_corpus, run_cli, run_group, run_main, tiny_run
from omegaconf import OmegaConf

from gptkit.model import ModelConfig

STEPS = 6
# fp32: the reduction order of 2 ranks vs 1 differs in the last bits
TOL = 1e-5


corpus = module_corpus(40_000)


def args(corpus: Path, runs: Path, name: str, world: int, *extra: str) -> list[str]:
    """The same global batch (4 sequences) whatever the world size: per-device batch = 4 / world."""
    keys = dict(layers=2, dropout=0.0, val_fraction=0.1, batch_size=4 // world, steps=STEPS, val_every=4)
    return tiny_run(corpus, runs, name, *extra, **keys, val_windows=5, checkpoint_every=2, accelerator="cpu")


def train(*argv: str, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    r = run_group("-m", "gptkit", "train", *argv, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def losses(run_dir: Path, key: str = "train/loss") -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}


def assert_same_trajectory(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (sorted(got), sorted(want))
    for step in want:
        assert abs(got[step] - want[step]) < TOL, (step, got[step], want[step])


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """One process, global batch 4, STEPS steps (checkpoints at steps 2, 4 and 6)."""
    runs = tmp_path_factory.mktemp("ref")
    train(*args(corpus, runs, "single", 1))
    return runs / "single"


@pytest.mark.long
def test_ddp_matches_one_process_and_resumes_across_world_sizes(corpus, reference, tmp_path):
    want = losses(reference)
    # the loss moves: equal trajectories are not a coincidence
    assert len(set(want.values())) == STEPS
    # 2 processes for 3 steps, then 1 process continues: 2 -> 1
    train(
        *args(
            corpus, tmp_path, "two-then-one", 2, "trainer=ddp", "trainer.devices=2", "trainer.stop_at_step=3"
        )
    )
    assert torch.load(tmp_path / "two-then-one/checkpoints/last.ckpt", weights_only=True)["global_step"] == 3
    train(
        "resume=" + str(tmp_path / "two-then-one"),
        "trainer.strategy=auto",
        "trainer.devices=1",
        "trainer.batch_size=4",
    )
    assert_same_trajectory(losses(tmp_path / "two-then-one"), want)
    # 1 -> 2: the single run's step-2 checkpoint continued by 2 processes
    shutil.copytree(reference, tmp_path / "one-then-two")
    for later in ("last", "step-000004", "step-000006"):
        (tmp_path / f"one-then-two/checkpoints/{later}.ckpt").unlink()
    train(
        "resume=" + str(tmp_path / "one-then-two/checkpoints/step-000002.ckpt"),
        "trainer.strategy=ddp",
        "trainer.devices=2",
        "trainer.batch_size=2",
    )
    assert_same_trajectory(losses(tmp_path / "one-then-two"), want)
    # val/loss is the token mean over the 5 distinct val windows on 2 ranks too: DistributedSampler pads
    # rank 1 with a repeat of window 0, which is not counted (nor are the batches of 4 + 1 weighted as 2)
    got, ref = losses(tmp_path / "one-then-two", "val/loss"), losses(reference, "val/loss")
    assert sorted(got) == sorted(ref) == [4, 6]
    assert all(abs(got[s] - ref[s]) < 1e-4 for s in ref), (got, ref)


@pytest.mark.long
def test_fsdp_matches_and_its_sharded_checkpoint_consolidates_and_loads(corpus, reference, tmp_path):
    from gptkit.checkpoints import model_state_dict
    from gptkit.runs import load_model

    run = tmp_path / "fsdp"
    r = train(
        *args(
            corpus,
            tmp_path,
            "fsdp",
            2,
            "trainer=fsdp",
            "trainer.devices=2",
            "trainer.precision=32-true",
            "trainer.stop_at_step=3",
        )
    )
    # rank 1 built its model on the meta device and got rank 0's weights: the trajectory below could not match
    # the single process's otherwise
    assert "the other 1 rank(s) start on the meta device" in r.stderr, r.stderr[-2000:]
    sharded = run / "checkpoints/step-000002.ckpt"
    # one shard per rank
    assert (sharded / ".metadata").is_file() and len(list(sharded.glob("*.distcp"))) == 2
    # the 2-rank shards continue in one process (FSDP over a world of 1: the shards are re-split on load)
    train("resume=" + str(run), "trainer.devices=1", "trainer.batch_size=4")
    assert_same_trajectory(losses(run), losses(reference))
    # consolidate the step-2 shards into one file; it holds the weights the single process had at step 2
    r = run_cli("consolidate", f"run={sharded}")
    assert r.returncode == 0, r.stderr[-2000:]
    merged_file = run / "checkpoints/step-000002.consolidated.ckpt"
    merged = torch.load(merged_file, weights_only=True)
    want = torch.load(reference / "checkpoints/step-000002.ckpt", weights_only=True)
    assert merged["global_step"] == 2 and merged["state_dict"].keys() == want["state_dict"].keys()
    for k, v in want["state_dict"].items():
        torch.testing.assert_close(merged["state_dict"][k], v, atol=TOL, rtol=0)
    # keyed by parameter index
    got_opt, want_opt = merged["optimizer_states"][0], want["optimizer_states"][0]
    assert [g["params"] for g in got_opt["param_groups"]] == [g["params"] for g in want_opt["param_groups"]]
    for i, state in want_opt["state"].items():
        for k, v in state.items():
            torch.testing.assert_close(got_opt["state"][i][k], v, atol=TOL, rtol=0)
    # sample/eval/export (runs.load_model) read the sharded folder itself, and the consolidated file
    _, _, _, _, model = load_model(sharded)
    sd = model.state_dict()
    for k, v in model_state_dict(want).items():
        torch.testing.assert_close(sd[k], v, atol=TOL, rtol=0)
    _, _, _, _, model = load_model(merged_file)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    # 1 -> FSDP2 on 2: the single run's step-2 file, whose AdamW state is keyed by the parameter's index in
    # gptkit's group order (decayed weights first), continued sharded (it put one weight's moments on
    # another's shard: "The size of tensor a (64) must match the size of tensor b (256)")
    shutil.copytree(reference, tmp_path / "one-then-fsdp")
    for later in ("last", "step-000004", "step-000006"):
        (tmp_path / f"one-then-fsdp/checkpoints/{later}.ckpt").unlink()
    train(
        "resume=" + str(tmp_path / "one-then-fsdp/checkpoints/step-000002.ckpt"),
        "trainer=fsdp",
        "trainer.devices=2",
        "trainer.batch_size=2",
        "trainer.precision=32-true",
    )
    assert_same_trajectory(losses(tmp_path / "one-then-fsdp"), losses(reference))


@pytest.mark.long
def test_fsdp_trains_a_hybrid_as_one_process(corpus, tmp_path):
    """A Gated DeltaNet + softmax hybrid, every parameter training (A_log, dt_bias, the conv1d's taps too):
    FSDP2 on 2 processes, stopped at step 3 and resumed in one, follows one process."""
    keys = dict(layers=2, dropout=0.0, val_fraction=0.1, steps=STEPS, val_every=4, val_windows=5)
    keys.update(checkpoint_every=3, accelerator="cpu", model="gdn-tiny")

    def hybrid(name, world, *extra):
        return tiny_run(corpus, tmp_path, name, *HYBRID, *extra, batch_size=4 // world, **keys)

    train(*hybrid("one", 1))
    assert "- linear\n" in (tmp_path / "one" / "config.yaml").read_text()
    fsdp = ("trainer=fsdp", "trainer.devices=2", "trainer.precision=32-true", "trainer.stop_at_step=3")
    r = train(*hybrid("fsdp", 2, *fsdp))
    assert "the other 1 rank(s) start on the meta device" in r.stderr, r.stderr[-2000:]
    train("resume=" + str(tmp_path / "fsdp"), "trainer.devices=1", "trainer.batch_size=4")
    want = losses(tmp_path / "one")
    assert len(set(want.values())) == STEPS
    assert_same_trajectory(losses(tmp_path / "fsdp"), want)


@pytest.mark.long
def test_a_failing_rank_ends_the_job_with_its_message(corpus, tmp_path):
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(
        "import sys\n"
        "from gptkit.errors import GptkitError\n"
        "from gptkit.training.module import LitGPT\n"
        "step = LitGPT.training_step\n"
        "def failing(self, batch, i):\n"
        "    if self.global_rank == 1 and self.global_step == 2:\n"
        "        raise GptkitError('rank 1 broke on purpose')\n"
        "    return step(self, batch, i)\n"
        "LitGPT.training_step = failing\n"
        "from gptkit.cli import main\n"
        "sys.exit(main())\n"
    )
    r = run_group(
        str(script),
        "train",
        *args(corpus, tmp_path, "fails", 2, "trainer=ddp", "trainer.devices=2"),
    )
    assert r.returncode != 0
    assert "rank 1 broke on purpose" in r.stderr
    assert not (tmp_path / "fails/checkpoints/step-000006.ckpt").exists()


def test_several_nodes_without_a_launcher_fail_in_one_line_before_any_process_starts(corpus, tmp_path):
    r = run_group(
        "-m",
        "gptkit",
        "train",
        *args(corpus, tmp_path, "bad", 1),
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.num_nodes=2",
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: trainer.num_nodes=2 needs a launcher"), r.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=4096"],
            "4096 CPU processes but this machine has",
        ),
        (["trainer=ddp", "trainer.accelerator=gpu", "trainer.devices=8"], "no CUDA GPU is visible"),
        (
            ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=16-mixed"],
            "use bf16-mixed",
        ),
        (
            ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.fsdp.param_dtype=fp8"],
            "must be auto, fp32 or bf16",
        ),
        (["trainer.strategy=deepspeed"], "not one of auto, ddp, fsdp"),
    ],
)
def test_bad_distributed_setups_are_refused(overrides, message):
    """The same checks `train` and `preflight` run first (the CLI turns them into one line, as above)."""
    from gptkit.conf_tree import compose
    from gptkit.errors import GptkitError
    from gptkit.training.distributed import check_distributed

    if "CUDA" in message and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(GptkitError, match=message):
        check_distributed(compose("train", overrides).trainer)


def test_presets_resolve_their_world_size():
    from gptkit.conf_tree import compose
    from gptkit.training.distributed import check_distributed, world_size

    for preset in ("default", "ddp", "fsdp"):
        t = compose("train", [f"trainer={preset}", "trainer.accelerator=cpu", "trainer.devices=2"]).trainer
        check_distributed(t)
        assert world_size(t) == 2 and t.strategy == {"default": "auto"}.get(preset, preset)


def test_preflight_runs_an_all_reduce_over_two_ranks_and_checks_memory(monkeypatch):
    """Also the report's shape: each rank's host and SLURM node (SLURMD_NODENAME, as slurmd sets it), and the
    all-reduce bandwidth per link as a figure (loopback: one host). .ci/slurm runs it under a real srun."""
    monkeypatch.setenv("SLURMD_NODENAME", "node-a")
    monkeypatch.setenv("COLUMNS", "240")
    r = run_group(
        "-m",
        "gptkit",
        "preflight",
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "model=llama3-70b",
    )
    assert "gloo" in r.stdout and "sum 1 (expected 1)" in r.stdout, r.stdout + r.stderr[-2000:]
    flat = " ".join(r.stdout.split())
    assert re.search(
        r"all-reduce bandwidth │ \d+\.\d\d GB/s per link .* over loopback: every rank on host", flat
    ), flat
    host = socket.gethostname()
    rows = [
        [c.strip() for c in line.split("│")[1:-1]] for line in r.stdout.splitlines() if line.count("│") > 6
    ]
    ranks = {row[0]: row[1:3] for row in rows if row[0] in ("0", "1")}
    assert ranks == {"0": [host, "node-a"], "1": [host, "node-a"]}, r.stdout
    assert all(float(row[-1]) > 0 for row in rows if row[0] in ("0", "1")), r.stdout
    # the one error line (another rank's warnings, such as Lightning's about srun where slurm-wlm is
    # installed, may come after it on the shared stderr)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert errors[0].startswith("error: preflight failed: training needs"), r.stderr


@pytest.mark.long
def test_compiled_fsdp_resumes_compiled_under_ddp_on_the_same_trajectory(corpus, reference, tmp_path):
    """trainer.compile=true under FSDP2 (2 ranks, stopped at step 3), resumed compiled under DDP (2 ranks):
    the same losses as the eager single process (aot_eager: torch.compile's tracing and autograd, no code
    generation)."""
    compiled = ("trainer.compile=true", "trainer.compile_backend=aot_eager", "trainer.precision=32-true")
    train(
        *args(
            corpus, tmp_path, "c", 2, "trainer=fsdp", "trainer.devices=2", "trainer.stop_at_step=3", *compiled
        )
    )
    train(
        "resume=" + str(tmp_path / "c"), "trainer=ddp", "trainer.devices=2", "trainer.batch_size=2", *compiled
    )
    assert_same_trajectory(losses(tmp_path / "c"), losses(reference))


def test_a_node_that_never_joins_fails_in_one_line_within_the_rendezvous_timeout(tmp_path):
    """`python -m gptkit.torchrun` is torchrun; node 0 started alone gives up at join_timeout with one line
    (plain torchrun: its agent's 40-line traceback). .ci/multinode runs this, and the rest, on real jobs."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=alone"]
    r = run_group("-m", "gptkit.torchrun", *rdzv, "--rdzv-conf=join_timeout=1", "-m", "gptkit", "--version")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: torchrun's rendezvous"), r.stderr[-3000:]
    assert f"127.0.0.1:{port}" in lines[0] and "join_timeout=1s" in lines[0] and "--nnodes=2" in lines[0]


def test_a_torchrun_restart_continues_its_run_and_runs_clean(tmp_path, monkeypatch):
    """What a worker torchrun restarts (--max-restarts) does with the same command line: it continues the
    run folder its first attempt published a checkpoint in; GPTKIT_FAULT fires on the first attempt only;
    the shared rendezvous store, which hands a restart the previous attempt's addresses, is refused."""
    from gptkit import faults
    from gptkit.conf_tree import compose
    from gptkit.errors import GptkitError
    from gptkit.training.distributed import check_distributed, elastic_resume

    keys = {"name": "r", "runs_dir": str(tmp_path), "resume": None, "init_from": None}
    (tmp_path / "r/checkpoints").mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    # no checkpoint published before the failure: the run starts over
    assert elastic_resume(keys) is None
    (tmp_path / "r/checkpoints/last.ckpt").write_bytes(b"")
    assert elastic_resume(keys) == tmp_path / "r"
    assert elastic_resume({**keys, "resume": str(tmp_path / "other")}) is None
    # a fine-tune's restart continues it too (not a new run from init_from= again, refused in that folder)
    assert elastic_resume({**keys, "init_from": str(tmp_path / "base")}) == tmp_path / "r"
    # the first attempt: a new run, which a folder with checkpoints refuses (as without torchrun)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert elastic_resume(keys) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setattr(faults, "_passes", {})
    monkeypatch.setenv(faults.ENV, "step")
    faults.fault_point("step")
    assert killed == []
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    faults.fault_point("step")
    assert len(killed) == 1
    t = compose("train", ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=1"]).trainer
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(GptkitError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_distributed(t)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    check_distributed(t)


def test_a_rank_that_stops_with_an_error_under_torchrun_stops_the_others_in_one_line(monkeypatch, capsys):
    """training/elastic.py's watch_peers, against a real TCPStore as torchrun's agent shares it: a rank's
    GptkitError is left in the store for the others, and a rank that finds one there says it in one line and
    exits 2 (before: it waited in init_process_group for the rank that never came, .ci/recipes' checksums)."""
    import os
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from gptkit.errors import GptkitError
    from gptkit.training import elastic

    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(server.port), "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    # rank 1 refuses its data: its line is left for the others, and it still raises
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(GptkitError, match="train.bin is corrupted"):
        with elastic.watch_peers():
            raise GptkitError("/n1/train.bin is corrupted")
    assert server.get("gptkit/stopped/0") == b"rank 1 stopped: /n1/train.bin is corrupted"
    # rank 0, waiting (in init_process_group, say), finds it: one line, exit 2
    monkeypatch.setenv("RANK", "0")
    exits, stopped = [], threading.Event()

    def exit_(code):
        exits.append(code)
        stopped.set()

    monkeypatch.setattr(os, "_exit", exit_)
    with elastic.watch_peers():
        assert stopped.wait(HANG_S)
    assert exits == [2]
    assert capsys.readouterr().err.splitlines() == [
        "error: rank 1 stopped: /n1/train.bin is corrupted; this rank stops too"
    ]
    # another torchrun attempt (a restart) reads only its own; outside a torchrun job nothing is watched
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    stopped.clear()
    with elastic.watch_peers():
        assert not stopped.wait(3 * elastic.WATCH_S)
    assert exits == [2]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert elastic._agent_store() is None


SCONTROL = """#!/bin/sh
# scontrol as the controller answers for a batch job: its script (write batch_script), its fields (show job)
case "$1" in
  write) cat "$FAKE_SCRIPT" ;;
  show) echo "JobId=$4 JobName=gptkit-cpu JobState=RUNNING Requeue=1 TimeLimit=$FAKE_LIMIT Partition=ci" ;;
  *) exit 1 ;;
esac
"""


def test_a_slurm_signal_needs_a_time_limit_to_count_back_from(tmp_path, monkeypatch, capsys):
    """A batch job whose #SBATCH --signal (the requeue signal) has no time limit (TimeLimit=UNLIMITED) never
    gets it, and one whose limit is shorter than the signal's lead gets it at once: `gptkit train` refuses
    both in one line, exit 2, before a run folder exists. SLURM exposes neither in the environment: scontrol
    says (faked here: no daemons; .ci/slurm submits the docs' script with --time=UNLIMITED to a real
    cluster)."""
    from gptkit.errors import ConfigError
    from gptkit.training.slurm import check_slurm_signal, sbatch_options, signal_problem, time_limit_seconds

    script = (REPO / "docs/examples/slurm-cpu.sbatch").read_text()
    # the documented script asks for the signal and gives the limit
    options = sbatch_options(script)
    assert options["signal"] == "TERM@60" and options["time"] == "00:30:00" and "requeue" in options
    assert sbatch_options("#!/bin/bash\n#SBATCH -t 5 --signal=B:USR1@90\necho\n#SBATCH --time=1\n") == {
        "time": "5",
        "signal": "B:USR1@90",
    }
    limits = ("1-02:03:04", "00:30:00", "05:00", "UNLIMITED", "365-00:00:00")
    assert [time_limit_seconds(x) for x in limits] == [93784, 1800, 300, None, None]
    assert signal_problem("7", "TERM@60", "00:30:00") is None
    assert "before the run starts" in signal_problem("7", "TERM", "00:01:00")
    answers = {"write": script, "show": "JobId=7 TimeLimit=UNLIMITED"}
    fake = lambda *a: answers[a[0]]  # noqa: E731
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "gptkit-cpu"}
    with pytest.raises(ConfigError, match="no time limit"):
        check_slurm_signal(slurm, fake)
    # no --signal, an interactive shell, or no job: nothing to refuse
    check_slurm_signal(
        slurm, lambda *a: "#!/bin/bash\n#SBATCH --time=5\n" if a[0] == "write" else answers[a[0]]
    )
    check_slurm_signal({**slurm, "SLURM_JOB_NAME": "bash"}, fake)
    check_slurm_signal({}, fake)
    # SBATCH_SIGNAL (sbatch's variable for --signal) counts as the option
    with pytest.raises(ConfigError, match="no time limit"):
        check_slurm_signal({**slurm, "SBATCH_SIGNAL": "TERM@120"}, lambda *a: answers["show"])

    # the CLI (in process), with a scontrol on PATH
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text(SCONTROL)
    (bin_ / "scontrol").chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    for k, v in {**slurm, "FAKE_SCRIPT": str(tmp_path / "job.sbatch"), "FAKE_LIMIT": "UNLIMITED"}.items():
        monkeypatch.setenv(k, v)
    code, _, err = run_main(
        capsys, "train", "tokenizer=char", "trainer.accelerator=cpu", "name=s", f"runs_dir={tmp_path}/runs"
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    for needle in ("error: SLURM job 7 asks for --signal=TERM@60", "TimeLimit=UNLIMITED", "#SBATCH --time="):
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()


TP2 = ["trainer=fsdp", "trainer.devices=2", "trainer.tensor_parallel=2"]
TP3 = ["trainer=fsdp", "trainer.devices=3", "trainer.tensor_parallel=3"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.tensor_parallel=2"], "needs trainer=fsdp"),
        (["trainer=fsdp", "trainer.devices=2", "trainer.tensor_parallel=4"], "is larger than the job's 2"),
        (TP2 + ["trainer.sample_every=5"], "trainer.sample_every with trainer.tensor_parallel=2"),
        (TP3 + ["model=gpt2-tiny"], "must divide model.n_heads=4"),
        (TP3 + ["model=llama-tiny", "model.n_heads=6", "model.head_dim=16"], "n_kv_heads=2: one must divide"),
        (["trainer=fsdp", "trainer.devices=4", "trainer.tensor_parallel=4", "model=llama-tiny"], None),
        (TP2 + ["model=moe-tiny"], None),
        (TP2 + ["model=llama-tiny", "finetune=lora"], "finetune=lora is not supported"),
    ],
)
def test_tensor_parallel_refusals_before_torch(overrides, message):
    """trainer.tensor_parallel's one-line refusals (config_checks.py: torch-free): the trainer group, then the
    model, fine-tune and objective it splits."""
    from gptkit.conf_tree import compose
    from gptkit.errors import ConfigError
    from gptkit.training.config_checks import check_tensor_parallel_model

    cfg = compose("train", overrides)
    model = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    if message is None:
        check_tensor_parallel_model(cfg, model)
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_tensor_parallel_model(cfg, model)


def test_tensor_and_context_parallel_together_need_a_mesh_that_divides_the_job():
    """trainer.tensor_parallel x trainer.context_parallel (the ring over TP-local heads: the numbers are
    .ci/context_tensor_parallel.py's): accepted when tp x cp divides the processes, else one line."""
    from gptkit.conf_tree import compose
    from gptkit.errors import ConfigError
    from gptkit.training.config_checks import check_mesh_shape, check_tensor_parallel

    both = ["trainer.tensor_parallel=2", "trainer.context_parallel=2"]
    cfg = compose("train", TP2[:1] + ["trainer.devices=4", *both])
    assert check_tensor_parallel(cfg.trainer) == 2
    # (dp_replicate, cp, tp, ep)
    assert check_mesh_shape(cfg.trainer) == (1, 2, 2, 1)
    cfg = compose("train", TP2[:1] + ["trainer.devices=6", *both])
    assert check_tensor_parallel(cfg.trainer) == 2
    with pytest.raises(ConfigError, match="context_parallel=2 does not divide the 3 rank"):
        check_mesh_shape(cfg.trainer)


def test_tensor_parallel_plan_on_one_rank_matches_the_model_and_its_state_reads_back(tmp_path):
    """apply_tensor_parallel on a 1-rank gloo mesh (the plan's structure; the numbers over 2 and 4 ranks are
    .ci/tensor_parallel.py's): the q/k/v split holding qkv_proj's rows, heads and MLP DTensors of the planned
    placements, a tied head one parameter, the loss under loss_parallel that of the plain model; the state
    dict fuses back (fuse_qkv_state) to the plain model's, and split_qkv_state inverts it. kv_layout: K/V
    heads split, or replicated with each rank its group's head."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from gptkit.model import GPT
    from gptkit.model.mha import fuse_qkv_state
    from gptkit.training.tensor_parallel import (
        QKVParallel,
        apply_tensor_parallel,
        kv_layout,
        local_loss,
        loss_context,
        split_qkv_state,
    )

    assert kv_layout(8, 4, 2, 1) == (4, 2, None)
    assert [kv_layout(8, 2, 4, r) for r in range(4)] == [(2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1)]
    cfg = ModelConfig.from_dict(
        dict(
            vocab_size=37, max_seq_len=8, n_layers=1, n_heads=4, n_kv_heads=2, d_model=16, d_ff=24,
            position="rope", mlp="swiglu", norm="rmsnorm", bias=False, tie_embeddings=True, dropout=0.0,
        )
    )  # fmt: skip
    torch.manual_seed(0)
    plain = GPT(cfg)
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    x = torch.randint(0, 37, (2, 8))
    want = plain(x, x).loss
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = GPT.from_state(cfg, state).train()
        apply_tensor_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tensor_parallel",)))
        attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
        assert isinstance(attn.qkv_proj, QKVParallel)
        assert attn.qkv_proj.k.weight.placements == (Shard(0),) and attn.o_proj.weight.placements == (
            Shard(1),
        )
        assert mlp.up_proj.weight.placements == (Shard(0),) and mlp.down_proj.weight.placements == (Shard(1),)
        assert model.blocks[0].attn_norm.weight.placements == (Replicate(),)
        assert model.tok_emb.weight is model.lm_head.weight and isinstance(model.lm_head.weight, DTensor)
        with loss_context(model):
            got = model(x, x).loss
            local_loss(got).backward()
        assert torch.allclose(local_loss(got), want, atol=1e-6)
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert "blocks.0.attn.qkv_proj.k.weight" in full
        fused = fuse_qkv_state(full)
        assert fused.keys() == state.keys() and all(torch.equal(fused[k], state[k]) for k in state)
        assert split_qkv_state(state, model).keys() == full.keys()
    finally:
        if started:
            dist.destroy_process_group()


def test_moe_under_tensor_parallel_on_one_rank_is_the_plain_model(tmp_path):
    """apply_tensor_parallel of a mixture (a dense layer, then an MoE one with a gated shared expert, router
    and expert biases) on a 1-rank gloo mesh (4 and 8 ranks: .ci/expert_tensor_parallel.py): the router and
    shared experts replicated DTensors, the experts too (expert_parallel 1) or left to expert
    parallelism; the loss, the auxiliary loss over the group (moe_tensor_parallel), the router figures and
    every gradient those of the plain model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from gptkit.model import GPT
    from gptkit.training.tensor_parallel import apply_tensor_parallel, local_loss, loss_context

    moe = dict(
        n_experts=4, top_k=2, d_expert=24, n_shared=1, shared_expert_gate=True, first_dense=1,
        router_bias=True, expert_biases=True, bias_update_rate=0.01, z_loss_coef=0.001, impl="loop",
    )  # fmt: skip
    cfg = ModelConfig.from_dict(
        dict(
            vocab_size=37, max_seq_len=8, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16, d_ff=24,
            position="rope", mlp="swiglu", norm="rmsnorm", bias=False, dropout=0.0, moe=moe,
        )
    )  # fmt: skip
    torch.manual_seed(0)
    plain = GPT(cfg).train()
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    x = torch.randint(0, 37, (2, 8))
    want = plain(x, x)
    (want.loss + want.aux.loss).backward()
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        for ep in (1, 2):
            model = GPT.from_state(cfg, state).train()
            apply_tensor_parallel(
                model, init_device_mesh("cpu", (1,), mesh_dim_names=("tensor_parallel",)), ep
            )
            layer = model.blocks[1].mlp
            assert layer.router.weight.placements == (Replicate(),)
            assert layer.shared.up_proj.weight.placements == (Replicate(),)
            assert isinstance(layer.experts.up_proj, DTensor) == (ep == 1)
            assert not isinstance(layer.expert_bias, DTensor)
            with loss_context(model):
                got = model(x, x)
                (local_loss(got.loss) + got.aux.loss).backward()
            assert torch.allclose(local_loss(got.loss), want.loss, atol=1e-6)
            assert torch.allclose(got.aux.loss, want.aux.loss, atol=1e-7)
            for a, b in zip(got.aux.layers[0], want.aux.layers[0]):
                assert torch.allclose(a, b, atol=1e-6)
            grads = {n: p.grad for n, p in plain.named_parameters()}
            for name, p in model.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                name = name.replace("qkv_proj.q.", "qkv_proj.").replace("qkv_proj.k.", "qkv_proj.")
                if ".qkv_proj." not in name:
                    assert torch.allclose(g, grads[name], atol=1e-6), name
    finally:
        if started:
            dist.destroy_process_group()
