"""Downstream task evals during training (trainer.eval_tasks): every trainer.eval_every optimizer steps
(and after the last), a fixed subset of each task (its first trainer.eval_limit examples, the same prompts
every time) is scored through gptkit's lm-eval adapter and `eval/<task>/<metric>` goes to metrics.csv and
every logger, at the step of the weights it scored (as val/loss).

Under DDP each rank scores its share of the examples (rank, rank + world, ...); the per-example values are
gathered and rank 0 logs the metrics over all of them. Under FSDP2 (sharded weights: every forward is a
collective that gathers each block's weights) the ranks run their shares in lockstep (Lockstep): before each
forward of its own a rank says so, and a rank whose share is done joins the others' remaining forwards with
a one-token forward whose output it drops, as the GRPO rollouts do (gptkit/inference/rollouts.py). No rank
ever holds the whole model. The time spent is kept out of tokens/s and
reported at the end (`gptkit train` prints it with the summary).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from lightning.pytorch.callbacks import Callback

from gptkit.errors import ConfigError
from gptkit.evaluation import tasks as T
from gptkit.runs import is_rank_zero
from gptkit.training.metrics import optimizer_stepped


def check_task_evals(t: Any) -> None:
    """trainer.eval_tasks / eval_every / eval_limit, checked before any data is prepared (task names are
    looked up in lm-eval's registry when training starts)."""
    tasks = t.get("eval_tasks")
    if not tasks:
        return
    T.require_lm_eval()
    entries = T.parse_tasks(list(tasks) if not isinstance(tasks, str) else tasks)
    # reading a task YAML runs the Python its !function tags name: said first (once, by rank 0)
    if is_rank_zero():
        for line in T.code_notices(entries, "trainer.eval_tasks"):
            print(line, file=sys.stderr)
    # local YAMLs exist; a Hub that cannot serve the data sets is one line before any data is prepared
    T.check_hub(T.find_tasks(entries, "trainer.eval_tasks"))
    for key in ("eval_every", "eval_limit"):
        value = t.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"trainer.{key}={value} must be an integer >= 1 (or null)")


class Lockstep:
    """A sharded model (FSDP2) whose forwards every rank runs together: each call is one round (an
    all-reduce of "I have a forward", then the forward); drain() joins the other ranks' remaining rounds
    with a one-token forward until none has one. Every other attribute is the model's."""

    def __init__(self, model) -> None:
        self.model = model
        self.device = model.tok_emb.weight.device
        # forwards run only to keep the others company
        self.joined = 0

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def _round(self, mine: bool) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(mine)], device=self.device)
        dist.all_reduce(flag)
        return bool(flag.item())

    def __call__(self, *args, **kwargs):
        self._round(True)
        return self.model(*args, **kwargs)

    def drain(self) -> None:
        import torch

        with torch.no_grad():
            while self._round(False):
                self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device))
                self.joined += 1


def is_sharded(model) -> bool:
    """FSDP2 over a process group of more than one rank: forwards are collective."""
    import torch.distributed as dist

    return (
        bool(getattr(model, "_gptkit_sharded", False))
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def score_in_lockstep(subsets: list, lm) -> dict[str, dict[str, list]]:
    """Each subset's share scored with lm (a GptkitLM); over a sharded model in lockstep with the other
    ranks (Lockstep), drained once every share of this rank is done."""
    if not is_sharded(lm.model):
        return {s.name: s.score(lm) for s in subsets}
    import torch

    model = lm.model
    # one forward of every rank together, outside inference mode: FSDP2's gathered weights are then
    # ordinary tensors, which lm-eval's inference-mode forwards and generation's no-grad ones both update
    with torch.inference_mode(False), torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long, device=model.tok_emb.weight.device))
    lm.model = Lockstep(model)
    try:
        shares = {s.name: s.score(lm) for s in subsets}
        lm.model.drain()
    finally:
        lm.model = model
    return shares


def task_evals_callback(cfg: Any, clock=None) -> "TaskEvals | None":
    """The TaskEvals callback for trainer.eval_tasks (None when there are none)."""
    t = cfg.trainer
    tasks = t.get("eval_tasks")
    if not tasks:
        return None
    every = t.get("eval_every") or t.val_every
    eos = (cfg.get("tokenizer") or {}).get("eos_token")
    return TaskEvals(
        list(tasks) if not isinstance(tasks, str) else [tasks],
        int(every),
        t.get("eval_limit"),
        int(t.batch_size),
        eos,
        clock,
    )


class TaskEvals(Callback):
    def __init__(
        self,
        tasks: list[str],
        every: int,
        limit: int | None,
        batch_size: int,
        eos_token: str | None = None,
        clock=None,
    ) -> None:
        self.tasks, self.every, self.limit = tasks, every, limit
        self.batch_size, self.eos_token, self.clock = batch_size, eos_token, clock
        self.subsets: list = []
        # task -> why it is not scored
        self.skipped: dict[str, str] = {}
        # spent scoring, this invocation
        self.seconds = 0.0
        # of which in the model (the rest: lm-eval's filters and metrics)
        self.model_seconds = 0.0
        self.runs = 0
        self._last_step = -1
        self.last: dict[str, float] = {}

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self.subsets:
            return
        T.quiet_lm_eval()
        specs = T.find_tasks(T.parse_tasks(self.tasks), "trainer.eval_tasks")
        T.check_hub(specs)
        manager = T.task_manager(specs)
        T.check_names(specs.names, manager)
        loaded = T.leaf_tasks(T.load_tasks(specs, manager))
        # what the tokenizer cannot serve is skipped (and said) now, not at step eval_every; if all: one line
        lm = self._lm(trainer, pl_module)
        self.skipped = T.unscorable(loaded, lm)
        if self.skipped and len(self.skipped) == len(loaded):
            raise T.nothing_to_score(self.skipped)
        if trainer.is_global_zero:
            for name, why in self.skipped.items():
                print(T.skip_notice(name, why), file=sys.stderr)
        self.subsets = [
            T.TaskSubset(name, task, self.limit, trainer.global_rank, trainer.world_size)
            for name, task in loaded.items()
            if name not in self.skipped
        ]
        for s in self.subsets:
            for inst in s.instances:
                for text in inst.args:
                    if isinstance(text, str):
                        lm.tok_encode(text)

    def _lm(self, trainer, pl_module):
        # imports lm-eval, an optional dependency
        from gptkit.evaluation.lm_eval_adapter import GptkitLM

        return GptkitLM(
            pl_module.model,
            trainer.datamodule.prepared.tokenizer(),
            {"tokenizer": {"eos_token": self.eos_token}},
            batch_size=self.batch_size,
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if optimizer_stepped(trainer, batch_idx) and (
            trainer.global_step % self.every == 0 or trainer.global_step >= trainer.max_steps
        ):
            self.evaluate(trainer, pl_module)

    def evaluate(self, trainer, pl_module) -> dict[str, float]:
        """Score every subset on the current weights; rank 0 logs (and returns) the metrics."""
        step = trainer.global_step
        if step == self._last_step or not self.subsets:
            return {}
        self._last_step = step
        if self.clock is not None:
            self.clock.pause(trainer)
        t0 = time.perf_counter()
        model = pl_module.model
        was_training = model.training
        model.eval()
        try:
            lm = self._lm(trainer, pl_module)
            shares = score_in_lockstep(self.subsets, lm)
            self.model_seconds += lm.stats.seconds
        finally:
            model.train(was_training)
        if trainer.world_size > 1:
            import torch.distributed as dist

            gathered: list = [None] * trainer.world_size
            dist.all_gather_object(gathered, shares)
            shares = {s.name: T.merge_shares([g[s.name] for g in gathered]) for s in self.subsets}
        metrics: dict[str, float] = {}
        for s in self.subsets:
            metrics.update({f"eval/{k}": v for k, v in s.aggregate(shares[s.name]).items()})
        self.seconds += time.perf_counter() - t0
        self.runs += 1
        if self.clock is not None:
            self.clock.resume(trainer)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            self.last = metrics
        return metrics

    def summary(self, wall_s: float) -> str:
        """One line: what the task evals cost."""
        share = self.seconds / wall_s if wall_s else 0.0
        return (
            f"task evals: {self.runs} x {len(self.subsets)} task(s), {self.seconds:.1f} s "
            f"({share:.1%} of {wall_s:.1f} s wall time; {self.model_seconds:.1f} s in the model)"
        )

    def state_dict(self) -> dict[str, Any]:
        return {}


def print_summary(callback: TaskEvals | None, wall_s: float) -> None:
    if callback is not None and callback.runs:
        print(callback.summary(wall_s), file=sys.stderr)
