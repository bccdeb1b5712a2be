"""`gptkit verify`: before a long run, the run's own config (model family, data, tokenizer, optimizer,
precision, objective, fine-tuning) rehearsed at tiny width on the CPU, in minutes, and each invariant gptkit
promises checked on it, one line each:

    ranks         2 ranks = 1 rank: 2 processes (trainer=fsdp: FSDP2, else DDP over gloo) of batch 2 train as
                  1 process of batch 4 (the sampler gives each rank its slice; the gradient is the token mean)
    accumulation  accumulation 2 = batch x 2: 2 micro-batches of 2 train as one batch of their 4 rows (the
                  batch-4 run is given the rows the accumulating run draws: two micro-steps' draws joined)
    resume        resume after a kill = uninterrupted: killed (kill -9) after step 5, resumed from its step-4
                  checkpoint, it ends with the uninterrupted run's weights and losses, bit for bit
    packing       packed documents = unpacked: each document of a packed row (data.pack=documents, attention
                  inside each document) gets the logits it gets alone
    export        export -> import parity: `gptkit export` then `gptkit import` give back the same logits, and
                  transformers' own model of the exported folder the same within float error

The tiny model keeps the config's family (positions, MLP, norms, GQA ratio, QK-norm, tying, a mixture of
experts' routing) at 2 layers, d_model 64, 4 heads and a window of at most 64 tokens; init_from= (LoRA,
DPO) is replaced by a tiny base of that family with the source run's tokenizer. The runs train `steps`
optimizer steps (6) of batch 4 in the config's precision, one thread each, into `dir` (a temporary folder
by default).
Comparisons within float error are judged against a tolerance by precision (TOLERANCE); resume is exact.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from gptkit.checkpoints import (
    CHECKPOINT_DIR,
    LAST_CHECKPOINT,
    load_checkpoint,
    model_state_dict,
)
from gptkit.errors import ConfigError, GptkitError
from gptkit.hf.folders import export_folder
from gptkit.hf.parity import export_parity
from gptkit.model import GPT, ModelConfig
from gptkit.runs import find_run_checkpoint, load_model, load_tokenizer, read_config, write_run_folder

# (max |loss difference|, max |weight difference| / the largest weight) allowed where the order of float sums
# differs (ranks, accumulation), by the compute dtype of the precision
TOLERANCE = {"fp32": (1e-4, 1e-4), "bf16": (5e-2, 2e-2), "fp16": (2e-2, 1e-2)}
# the optimizer step a resume check kills its run after (checkpoints every 2 steps: it resumes from step 4)
KILL_AFTER = 5
# packed rows compared (rows holding two documents or more), looked for in this many micro-steps
PACKED_ROWS, PACKED_STEPS = 8, 500
# data kinds whose rows are whole records (the model's window kept)
ROW_KINDS = ("chat", "preference")
# the tiny width
TINY = {"n_layers": 2, "d_model": 64, "n_heads": 4, "max_seq_len": 64}


@dataclass
class Result:
    """One invariant's verdict: ok, FAIL or skip (it does not apply to this config), and what was measured."""

    name: str
    status: str
    detail: str


TITLES = {
    "ranks": "2 ranks = 1 rank",
    "accumulation": "accumulation 2 = batch x 2",
    "resume": "resume after a kill = uninterrupted",
    "packing": "packed documents = unpacked",
    "export": "export -> import parity",
}


def tiny_model(model: dict[str, Any], window: int | None = None) -> dict[str, Any]:
    """A model config of the same family at tiny width (module docstring); window: its max_seq_len (None: the
    model's, at most TINY's)."""
    m = dict(model)
    heads = TINY["n_heads"]
    kv = model.get("n_kv_heads") or model["n_heads"]
    ratio = max(1, int(model["n_heads"]) // int(kv))
    m.update(
        n_layers=TINY["n_layers"],
        d_model=TINY["d_model"],
        n_heads=heads,
        n_kv_heads=max(1, heads // ratio),
        head_dim=None if model.get("head_dim") is None else TINY["d_model"] // heads,
        d_ff=None if model.get("d_ff") is None else 2 * TINY["d_model"],
        max_seq_len=window or min(int(model["max_seq_len"]), TINY["max_seq_len"]),
        name=f"{model.get('name', 'model')}-verify",
    )
    types = m.get("layer_types")
    if isinstance(types, list) and len(types) != TINY["n_layers"]:
        # the first layer's type and the last's (Gemma 3: local, global; Qwen3-Next: linear, global)
        m["layer_types"] = [types[0], types[-1]]
    rope = m.get("rope_scaling")
    if isinstance(rope, dict) and "original_max_seq_len" in rope:
        m["rope_scaling"] = {**rope, "original_max_seq_len": min(int(rope["original_max_seq_len"]), 32)}
    moe = m.get("moe")
    if isinstance(moe, dict):
        n = min(int(moe.get("n_experts", 8)), 4)
        m["moe"] = {
            **moe,
            "n_experts": n,
            "top_k": min(int(moe.get("top_k", 2)), n - 1),
            "d_expert": TINY["d_model"],
            "n_shared": min(int(moe.get("n_shared", 0)), 1),
            "first_dense": min(int(moe.get("first_dense", 0)), 1),
            "every": min(int(moe.get("every", 1)), 2),
        }
    return m


class Rehearsal:
    """The config at tiny width and its runs (each a `gptkit train` into `dir`), made on first use."""

    def __init__(self, cfg: DictConfig, folder: Path, steps: int) -> None:
        self.dir, self.steps = folder, int(steps)
        # the 2-rank run's: the config's own when it shards (fsdp), else DDP
        self.strategy = "fsdp" if str(cfg.trainer.strategy) == "fsdp" else "ddp"
        # the family rehearsed (init_from=: its source's)
        self.family = str(cfg.model.name)
        self.cfg = self._tiny(cfg)
        self.runs: dict[str, Path] = {}
        self.precision = str(self.cfg.trainer.precision)

    def _tiny(self, cfg: DictConfig) -> DictConfig:
        c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        for key in ("invariants", "steps", "dir"):
            c.pop(key, None)
        # rows of conversations and pairs keep the model's window: a shorter one would drop or refuse records
        # the run keeps
        self.window = int(c.model.max_seq_len) if c.data.kind in ROW_KINDS else None
        c.model = tiny_model(OmegaConf.to_container(c.model, resolve=True), self.window)
        # the model rehearsed (init_from=: the tiny base's)
        self.model = dict(c.model)
        if c.get("init_from"):
            c.init_from = str(self._tiny_base(c))
        t = c.trainer
        t.accelerator, t.devices, t.num_nodes, t.strategy = "cpu", 1, 1, "auto"
        t.batch_size, t.accumulate_grad_batches = 4, 1
        t.max_steps, t.max_tokens, t.seq_len, t.stop_at_step = self.steps, None, None, None
        t.val_every, t.val_windows, t.checkpoint_every, t.keep_checkpoints = self.steps, 2, 2, None
        t.log_every, t.progress, t.threads, t.compile = 1, "off", 1, "none"
        t.eval_tasks, t.sample_every, t.keep_best, t.profile, t.spike_factor = [], None, False, None, None
        # experts over ranks needs ranks: the rehearsal's 2-rank run is plain DDP (or FSDP2)
        if "expert_parallel" in t:
            t.expert_parallel = 1
        # so does tensor parallelism (trainer.tensor_parallel; the rehearsal's model is not split)
        if "tensor_parallel" in t:
            t.tensor_parallel = 1
        # and HSDP's replicas (trainer.data_parallel_replicate)
        if "data_parallel_replicate" in t:
            t.data_parallel_replicate = 1
        c.optim.warmup_steps = 1
        c.logger = {"csv": {"enabled": True}}
        c.runs_dir, c.resume = str(self.dir), None
        return c

    def _tiny_base(self, c: DictConfig) -> Path:
        """init_from= replaced by a tiny model of the source's family with the source's tokenizer (and chat
        template), written as a run folder."""
        spec = str(c.init_from)
        if spec.startswith("hf:"):
            raise ConfigError(
                f"verify rehearses init_from= with a tiny model of the source run's family; init_from={spec} "
                "names a transformers model: import it first (gptkit import hf=... out=runs/<name>) and give "
                "init_from=runs/<name>"
            )
        source = find_run_checkpoint(spec, str(c.runs_dir)).parent
        source = source.parent if source.name == CHECKPOINT_DIR else source
        saved = read_config(source)
        tokenizer = load_tokenizer(source)
        model = tiny_model(saved["model"], self.window and int(saved["model"]["max_seq_len"]))
        self.family = saved["model"].get("name", "the init_from model")
        self.model = model
        model["vocab_size"] = max(int(model["vocab_size"]), tokenizer.get_vocab_size())
        torch.manual_seed(0)
        base = write_run_folder(
            self.dir / "base",
            {"tokenizer": saved.get("tokenizer", {})},
            GPT(ModelConfig.from_dict(model)),
            tokenizer,
        )
        for name in ("chat.json",):
            if (source / name).is_file():
                (base / name).write_bytes((source / name).read_bytes())
        return base

    def config(self, name: str, **trainer: Any) -> DictConfig:
        c = self.cfg.copy()
        c.name = name
        for k, v in trainer.items():
            c.trainer[k] = v
        return c

    def train_here(self, name: str, **trainer: Any) -> Path:
        """A run in this process (its output kept in <dir>/<name>.log)."""
        from gptkit.training.fit import train

        if name not in self.runs:
            with open(self.dir / f"{name}.log", "w") as out, contextlib.redirect_stderr(out):
                with contextlib.redirect_stdout(out):
                    train(self.config(name, **trainer))
            self.runs[name] = self.dir / name
        return self.runs[name]

    def train_process(self, name: str, cfg: DictConfig, env: dict[str, str] | None = None) -> int:
        """A run in its own process(es): `python -m gptkit.training.verify <its config>`; the exit status."""
        spec = self.dir / f"{name}.yaml"
        spec.write_text(OmegaConf.to_yaml(cfg))
        e = {k: v for k, v in os.environ.items() if k not in ("GPTKIT_FAULT", "GPTKIT_VERB")}
        e.update(env or {}, OMP_NUM_THREADS="1")
        with open(self.dir / f"{name}.log", "w") as out:
            return subprocess.run(
                [sys.executable, "-m", "gptkit.training.verify", str(spec)], stdout=out, stderr=out, env=e
            ).returncode

    def reference(self) -> Path:
        """The uninterrupted run of batch 4 that the others are compared with."""
        return self.train_here("reference")

    def tolerance(self) -> tuple[float, float]:
        from gptkit.precision import precision

        return TOLERANCE[precision(self.precision).compute]


def losses(run: Path) -> dict[int, float]:
    """{step: train/loss} of a run's metrics.csv (logged every step)."""
    with open(run / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def weights(run: Path) -> dict[str, torch.Tensor]:
    """The trained tensors of a run's last checkpoint (a LoRA run's: its adapters)."""
    return {
        k: v.float()
        for k, v in model_state_dict(load_checkpoint(run / CHECKPOINT_DIR / LAST_CHECKPOINT)).items()
    }


def compare(a: Path, b: Path) -> tuple[float, float, int]:
    """(max |train loss difference| over the steps, max |weight difference| / the largest weight, steps)."""
    la, lb = losses(a), losses(b)
    if sorted(la) != sorted(lb) or not la:
        raise GptkitError(f"{a} and {b} logged different steps ({sorted(la)} and {sorted(lb)})")
    wa, wb = weights(a), weights(b)
    top = max(float(v.abs().max()) for v in wa.values())
    dw = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    return max(abs(la[s] - lb[s]) for s in la), dw / top, len(la)


def within(name: str, how: str, a: Path, b: Path, tol: tuple[float, float]) -> Result:
    dl, dw, n = compare(a, b)
    ok = dl <= tol[0] and dw <= tol[1]
    detail = (
        f"{how}: train loss max |diff| {dl:.2g} over {n} steps, weights max |diff| {dw:.2g} of the largest "
        f"(tolerance {tol[0]:g}, {tol[1]:g})"
    )
    return Result(name, "ok" if ok else "FAIL", detail)


def check_ranks(r: Rehearsal) -> Result:
    ref = r.reference()
    strategy = r.strategy
    cfg = r.config("ranks", devices=2, strategy=strategy, batch_size=2)
    code = r.train_process("ranks", cfg)
    if code:
        return Result("ranks", "FAIL", f"the 2-process run failed (exit {code}); see {r.dir / 'ranks.log'}")
    return within(
        "ranks",
        f"{strategy.upper()}, 2 processes x batch 2 against 1 x batch 4",
        ref,
        r.dir / "ranks",
        r.tolerance(),
    )


@contextlib.contextmanager
def joined_micro_batches(k: int):
    """While it lasts, a run's training batch of step s is the k micro-batches that a run with accumulation
    k draws for that step (micro-steps s*k .. s*k+k-1, batch_size / k rows each), joined: the same rows in
    one batch."""
    from gptkit.data.datamodule import TrainBatches

    original = TrainBatches.__iter__

    def joined(self):
        part = copy.copy(self.sampler)
        part.batch_size = self.sampler.batch_size // k
        step = self.start_step
        while True:
            pieces = [part.batch(step * k + m, self.rank, self.world_size) for m in range(k)]
            yield tuple(torch.cat(t) for t in zip(*pieces))
            step += 1

    TrainBatches.__iter__ = joined
    try:
        yield
    finally:
        TrainBatches.__iter__ = original


def check_accumulation(r: Rehearsal) -> Result:
    run = r.train_here("accumulation", batch_size=2, accumulate_grad_batches=2)
    with joined_micro_batches(2):
        joined = r.train_here("joined", batch_size=4)
    return within(
        "accumulation",
        "batch 2 x 2 micro-batches against batch 4 of the same rows",
        joined,
        run,
        r.tolerance(),
    )


def check_resume(r: Rehearsal) -> Result:
    ref = r.reference()
    cfg = r.config("resume")
    code = r.train_process("resume", cfg, {"GPTKIT_FAULT": f"step@{KILL_AFTER}"})
    if code != -9:
        return Result(
            "resume",
            "FAIL",
            f"the run to kill ended with exit {code}, not by kill -9; see {r.dir / 'resume.log'}",
        )
    # as `gptkit train resume=<run>`: the run's saved config (its init_from= included) continues
    again = OmegaConf.create(
        {**OmegaConf.to_container(cfg), "resume": str(r.dir / "resume"), "init_from": None}
    )
    code = r.train_process("resume-continued", again)
    if code:
        return Result(
            "resume", "FAIL", f"the resume failed (exit {code}); see {r.dir / 'resume-continued.log'}"
        )
    la, lb = losses(ref), losses(r.dir / "resume")
    wa, wb = weights(ref), weights(r.dir / "resume")
    same = la == lb and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    dl, dw, n = compare(ref, r.dir / "resume")
    detail = (
        f"killed after step {KILL_AFTER}, resumed from step {KILL_AFTER - 1}: "
        + (
            "the same losses and weights, bit for bit"
            if same
            else f"train loss max |diff| {dl:.2g}, weights {dw:.2g}"
        )
        + f" over {n} steps"
    )
    return Result("resume", "ok" if same else "FAIL", detail)


def check_packing(r: Rehearsal) -> Result:
    from gptkit.data import prepare

    ref = r.reference()
    run_cfg = OmegaConf.create(read_config(ref))
    _, _, _, model_cfg, model = load_model(ref)
    packs = str(run_cfg.data.get("pack") or "stream") == "documents"
    if not packs and model_cfg.position == "learned" and not model_cfg.position_reset:
        return Result(
            "packing",
            "skip",
            "the run does not pack documents (data.pack=stream); with data.pack=documents this model "
            "(learned positions) needs model.position_reset=true",
        )
    # its "cache hit" line is not verify's
    with contextlib.redirect_stderr(io.StringIO()):
        prepared = prepare(
            run_cfg.data, run_cfg.tokenizer, progress=False, max_seq_len=int(run_cfg.model.max_seq_len)
        )
    seq_len = int(run_cfg.model.max_seq_len)
    try:
        feed = prepared.connect(4, seq_len, 1, 1, "documents")
        feed.sampler.batch(0)
    except GptkitError as exc:
        return Result("packing", "skip", f"data.pack=documents does not apply: {str(exc).split(';')[0]}")
    # rows that hold several documents, from the first micro-steps (at most PACKED_ROWS)
    rows = []
    for step in range(PACKED_STEPS):
        batch = feed.sampler.batch(step)
        if len(batch) < 3:
            return Result("packing", "skip", "this data kind's rows are not packed documents (no doc_ids)")
        rows += [(batch[0][i], batch[2][i]) for i in range(len(batch[0])) if batch[2][i].unique().numel() > 1]
        if len(rows) >= PACKED_ROWS:
            break
    if not rows:
        return Result(
            "packing", "skip", f"no row of the first {PACKED_STEPS} micro-steps holds two documents"
        )
    rows = rows[:PACKED_ROWS]
    worst, n = 0.0, 0
    with torch.no_grad():
        for x, ids in rows:
            packed = model(x[None], doc_ids=ids[None]).logits.float()[0]  # [T, vocab]
            for d in ids.unique().tolist():
                where = (ids == d).nonzero().flatten()
                a, b = int(where[0]), int(where[-1]) + 1
                alone = model(x[None, a:b]).logits.float()[0]  # [b - a, vocab]
                worst = max(worst, float((alone - packed[a:b]).abs().max()))
                n += 1
    tol = r.tolerance()[0]
    hint = ""
    if worst > tol and model_cfg.position == "learned" and not model_cfg.position_reset:
        hint = (
            "; with learned positions a packed document sees other positions than alone: set "
            "model.position_reset=true"
        )
    return Result(
        "packing",
        "ok" if worst <= tol else "FAIL",
        f"{n} documents in {len(rows)} packed rows of {seq_len} tokens against each alone: logits max |diff| "
        f"{worst:.2g} (tolerance {tol:g}){hint}",
    )


def check_export(r: Rehearsal) -> Result:
    ref = r.reference()
    ckpt = ref / CHECKPOINT_DIR / LAST_CHECKPOINT
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            export_folder(ckpt, r.dir / "exported", torch.float32, 5 << 30, force=True)
        ok, detail = export_parity(ckpt, r.dir / "exported")
    except GptkitError as exc:
        return Result("export", "FAIL", f"the model does not export: {exc}")
    return Result("export", "ok" if ok else "FAIL", detail)


INVARIANTS: dict[str, Callable[[Rehearsal], Result]] = {
    "ranks": check_ranks,
    "accumulation": check_accumulation,
    "resume": check_resume,
    "packing": check_packing,
    "export": check_export,
}


def check_invariants(names: Any) -> list[str]:
    """The invariants asked for (a list of INVARIANTS' names); an unknown one is a one-line error."""
    if isinstance(names, str) or not names:
        raise ConfigError(f"invariants={names!r} must be a non-empty list of {', '.join(INVARIANTS)}")
    wrong = [str(n) for n in names if n not in INVARIANTS]
    if wrong:
        raise ConfigError(f"unknown invariant {wrong[0]!r}; verify checks {', '.join(INVARIANTS)}")
    return [str(n) for n in names]


# in a folder verify writes its runs into: an earlier verify's folder may be emptied
MARK = ".gptkit-verify"


def fresh_folder(folder: Path) -> Path:
    """dir=: a new or empty folder, or one an earlier verify wrote (emptied); else a one-line error."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"dir={folder} is a file; give a folder for the rehearsal runs")
    if folder.is_dir() and any(folder.iterdir()):
        if not (folder / MARK).is_file():
            raise ConfigError(f"dir={folder} holds files verify did not write; give a new or empty folder")
        for p in folder.iterdir():
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARK).write_text(
        "rehearsal runs of gptkit verify; the next verify with dir= here replaces them\n"
    )
    return folder


def verify(cfg: DictConfig, out=None) -> int:
    """Rehearse `cfg` (a composed `verify` config: the train config plus invariants, steps, dir) and print
    one line per invariant; 0 when none failed, 1 otherwise."""
    out = out or sys.stdout
    names = check_invariants(cfg.invariants)
    steps = int(cfg.steps)
    if steps < KILL_AFTER + 1:
        raise ConfigError(
            f"steps={steps} must be >= {KILL_AFTER + 1} (the resume check kills after step {KILL_AFTER})"
        )
    keep = cfg.get("dir")
    with contextlib.ExitStack() as stack:
        if keep:
            folder = fresh_folder(Path(keep).expanduser())
        else:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gptkit-verify-")))
        rehearsal = Rehearsal(cfg, folder, steps)
        m = OmegaConf.create(rehearsal.model)
        print(
            f"gptkit verify: {rehearsal.family} at tiny width ({m.n_layers} layers, d_model {m.d_model}, "
            f"{m.n_heads} heads / {m.n_kv_heads} kv, window {m.max_seq_len}), data {cfg.data.kind}, "
            f"{rehearsal.precision}, optim {cfg.optim.name}, objective {cfg.get('objective', 'lm')}, "
            f"finetune {cfg.get('finetune', 'full')}; {steps} steps of batch 4 on the CPU"
            + (f", runs in {folder}" if keep else ""),
            file=out,
            flush=True,
        )
        # the run every other is compared with: a config that does not train is one line
        try:
            rehearsal.reference()
        except GptkitError as exc:
            raise GptkitError(f"the config does not train at tiny width: {exc}") from None
        failed = 0
        for name in names:
            t0 = time.perf_counter()
            try:
                res = INVARIANTS[name](rehearsal)
            except GptkitError as exc:
                res = Result(name, "FAIL", f"{type(exc).__name__}: {exc}")
            failed += res.status == "FAIL"
            print(
                f"  {res.status:<4}  {TITLES[name]:<36}  {res.detail} ({time.perf_counter() - t0:.0f} s)",
                file=out,
                flush=True,
            )
    print(
        f"{len(names) - failed} of {len(names)} invariants hold"
        + ("" if not failed else f"; {failed} failed"),
        file=out,
    )
    return 1 if failed else 0


def main() -> int:
    """`python -m gptkit.training.verify <config.yaml>`: one rehearsal run (and, under DDP, each rank that
    Lightning starts again with the same arguments)."""
    from gptkit.training.fit import train

    train(OmegaConf.load(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
