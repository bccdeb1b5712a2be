"""gptkit: train decoder-only transformer language models (GPT-2 and Llama style).

From Python: `gptkit.train(cfg)` runs one training (gptkit.training.launch.train: here, or with
trainer.launcher=ray in Ray Train's workers; the run itself: gptkit.training.fit); `gptkit.plan(cfg)` makes
its run plan first (steps, tokens, world size, the prepared data), which `gptkit.train(plan)` then runs; the
model alone is `from gptkit.model import GPT, ModelConfig`.
"""

from gptkit.version import __version__

__all__ = ["__version__", "plan", "train"]


def plan(cfg, **kwargs):
    """The run plan of one training (gptkit.training.plan.RunPlan), resolved as `gptkit train` resolves it:
    the run folder claimed, resume= / init_from= applied, the data prepared (plan.data), every fact derived
    once. `cfg`: a composed `train` config, a dict of one, or a list of key=value overrides such as
    ["model=llama-tiny", "trainer.max_steps=100"]; kwargs: run_dir=, overrides= (see fit.train)."""
    # imported on call: `import gptkit` (and `gptkit --help`) stays free of torch and Lightning
    from gptkit.training.fit import as_config, plan_run

    return plan_run(as_config(cfg), **kwargs)


def train(plan_or_cfg, **kwargs):
    """One training run (gptkit.training.launch.train). `plan_or_cfg`: a RunPlan (from gptkit.plan, or made
    with gptkit.training.plan.make_plan, which needs neither data nor a run folder: this call prepares the
    data and claims <runs_dir>/<name>), or what gptkit.plan takes. Returns a TrainResult (run_dir, step,
    val_loss, ...)."""
    from gptkit.training.fit import as_config, run_plan
    from gptkit.training.launch import train as launch_train
    from gptkit.training.plan import RunPlan

    if isinstance(plan_or_cfg, RunPlan):
        if kwargs:
            raise TypeError(
                f"gptkit.train(plan) takes no other arguments (got {', '.join(kwargs)}): the "
                f"plan holds the run"
            )
        return run_plan(plan_or_cfg)
    return launch_train(as_config(plan_or_cfg), **kwargs)
