"""Which documents trained step N: every batch of a run is a pure function of (seed, micro-step, rank, world
size), so the rows of any step are read back from the run's prepared data, without training anything. For
each row (sequence) of each micro-batch: the mixture's source, the documents it holds (their index, file,
line or byte offset, and how many of the row's tokens each gave) and the row's first characters.

Examples:
  gptkit trace run=runs/my-run step=1200
  gptkit trace run=latest step=1200 rank=1 micro_batch=0 chars=200
  gptkit trace run=runs/my-run step=1200 --json

Step N is made by micro-steps (N-1) x accumulation ... N x accumulation - 1 of every rank (the row N of
metrics.csv and the step a loss spike names). The run's plan.json says how each invocation drew its batches
(world size, accumulation, batch, window, seed); a run from before it was written is read from its config.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def run_folder(run, runs_dir) -> Path:
    """The run folder `run=` names (latest: the newest with a metrics.csv; a checkpoint: its run folder)."""
    from gptkit.checkpoints import run_dir_of
    from gptkit.errors import GptkitError
    from gptkit.runs import CONFIG_FILE, resolve_latest

    path = resolve_latest(str(run), str(runs_dir), need="metrics")
    if path.is_file():
        path = run_dir_of(path)
    if not (path / CONFIG_FILE).is_file():
        raise GptkitError(f"run={run}: {path} is not a run folder (it has no {CONFIG_FILE})")
    return path


def whole(value, key: str, low: int = 0) -> int | None:
    """An integer option >= low (None stays None); else a one-line error."""
    from gptkit.errors import ConfigError

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key}={value!r} must be an integer >= {low}")
    return int(value)


def draws(run_dir: Path, saved, step: int, world_size: int | None) -> dict:
    """How the batches of `step` were drawn: the run's plan.json invocation that trained it; a run from
    before plan.json: its config (trainer.devices x num_nodes, or world_size=), as `train` plans it."""
    from gptkit.errors import GptkitError
    from gptkit.runs import read_plan

    # checked: a hand-edited file is one line naming its field
    invocations = read_plan(run_dir, check=True)
    if invocations and invocations[0]["from_step"] > step:
        # trained before plan.json was written (resumed by a gptkit that writes it): planned as such a run
        invocations = []
    if invocations:
        last = invocations[-1]
        if step > int(last["max_steps"]):
            raise GptkitError(
                f"step={step} is beyond the run: {run_dir} plans {last['max_steps']} steps "
                f"(trainer.max_steps); trace a step in 1..{last['max_steps']}"
            )
        facts = dict(next(s for s in reversed(invocations) if s["from_step"] <= step))
    else:
        facts = planned(saved, world_size)
        if step > facts["max_steps"]:
            raise GptkitError(
                f"step={step} is beyond the run: {run_dir} plans {facts['max_steps']} steps "
                f"(trainer.max_steps); trace a step in 1..{facts['max_steps']}"
            )
    if world_size is not None and world_size != facts["world_size"]:
        print(
            f"note: world_size={world_size} given; the run recorded {facts['world_size']} for step {step}",
            file=sys.stderr,
        )
        facts["world_size"] = world_size
    return facts


def planned(saved, world_size: int | None) -> dict:
    """The draw facts of a run without plan.json, from its saved config (what make_plan derives)."""
    from omegaconf import OmegaConf

    from gptkit.model import ModelConfig
    from gptkit.training.distributed import devices_per_node
    from gptkit.training.objectives import objective_class
    from gptkit.training.plan import planned_steps, train_seq_len

    t = saved.trainer
    world = world_size if world_size is not None else devices_per_node(t) * int(t.num_nodes)
    objective = objective_class(saved)
    rows_per_item = objective.rows(objective.settings_of(saved))
    seq_len = train_seq_len(t, ModelConfig.from_dict(OmegaConf.to_container(saved.model, resolve=True)))
    accumulation = int(t.accumulate_grad_batches)
    tokens_per_step = int(t.batch_size) * rows_per_item * seq_len * accumulation * world
    return {
        "world_size": world,
        "accumulation": accumulation,
        "batch_size": int(t.batch_size),
        "rows_per_item": rows_per_item,
        "seq_len": seq_len,
        "seed": int(saved.seed),
        "max_steps": planned_steps(t, tokens_per_step),
    }


def trace(cfg) -> dict:
    """Everything `gptkit trace` shows, as plain data (the json output)."""
    from omegaconf import OmegaConf

    from gptkit.data import prepare
    from gptkit.errors import ConfigError
    from gptkit.runs import read_config

    step = whole(cfg.step, "step", 1)
    chars = whole(cfg.chars, "chars", 1)
    asked_world = whole(cfg.world_size, "world_size", 1)
    rank, micro = whole(cfg.rank, "rank"), whole(cfg.micro_batch, "micro_batch")
    run_dir = run_folder(cfg.run, cfg.runs_dir)
    saved = OmegaConf.create(read_config(run_dir))
    facts = draws(run_dir, saved, step, asked_world)
    world, accumulation = int(facts["world_size"]), int(facts["accumulation"])
    if rank is not None and rank >= world:
        raise ConfigError(f"rank={rank}: the run trained on {world} process(es), ranks 0..{world - 1}")
    if micro is not None and micro >= accumulation:
        raise ConfigError(
            f"micro_batch={micro}: step {step} has {accumulation} micro-batch(es) "
            f"(trainer.accumulate_grad_batches), 0..{accumulation - 1}"
        )
    prepared = prepare(saved.data, saved.tokenizer, progress=False, max_seq_len=int(saved.model.max_seq_len))
    prepared.wait_checked()
    feed = prepared.connect(
        int(facts["batch_size"]), int(facts["seq_len"]), int(facts["seed"]), 1, saved.data.get("pack")
    )
    batches = []
    for r in range(world) if rank is None else [rank]:
        for m in range(accumulation) if micro is None else [micro]:
            micro_step = (step - 1) * accumulation + m
            rows = feed.trace(micro_step, r, world, chars)
            batch = {
                "rank": r,
                "micro_batch": m,
                "micro_step": micro_step,
                "rows": [dataclasses.asdict(o) for o in rows],
            }
            if (saved.get("grpo") or {}).get("environment"):
                # grpo.environment: the episodes the rank played (written by the run)
                from gptkit.training.objectives.grpo_episodes import read_episodes

                batch["episodes"] = read_episodes(run_dir, micro_step, r)
            batches.append(batch)
    return {
        "run": str(run_dir),
        "step": step,
        "data": prepared.describe(),
        **{k: facts[k] for k in ("world_size", "accumulation", "batch_size", "seq_len", "seed")},
        "micro_batches": batches,
    }


def run(cfg) -> int:
    from gptkit.errors import ConfigError

    if cfg.format not in ("text", "json"):
        raise ConfigError(f"format={cfg.format!r} must be text or json")
    out = trace(cfg)
    if cfg.format == "json":
        print(json.dumps(out, indent=1, ensure_ascii=False))
        return 0
    print(
        f"{out['run']}, step {out['step']}: world size {out['world_size']}, {out['accumulation']} "
        f"micro-batch(es) of {out['batch_size']} x {out['seq_len']} tokens, seed {out['seed']}\n"
        f"data: {out['data']}"
    )
    for b in out["micro_batches"]:
        print(f"\nrank {b['rank']}, micro-batch {b['micro_batch']} (micro-step {b['micro_step']}):")
        for row in b["rows"]:
            part = f" of {row['part']}" if row["part"] else ""
            print(f"  row {row['row']}  {row['position']}{part}  {row['text']}")
            for s in row["spans"]:
                doc = f"document {s['document']:,}" if s["document"] is not None else "document ?"
                where = "  ".join(x for x in (s["source"], s["where"]) if x)
                print(f"      {doc}  {where}  ({s['tokens']:,} tokens)")
        for e in b.get("episodes", []):
            error = f", {e['error']}" if e["error"] else ""
            print(
                f"  episode {e['slot']}.{e['sample']}  {e['where']}  reward {e['reward']:.3f} (score "
                f"{e['score']:.3f}), ended by {e['stop']}{error}"
            )
            for k, t in enumerate(e["turns"], 1):
                calls = "; ".join(f"{c['name']}({json.dumps(c['arguments'])})" for c in t["calls"])
                said = (
                    f"calls {calls} -> {t['results']}" if calls else repr(t["text"][: int(cfg.chars or 80)])
                )
                print(f"      turn {k}: {said}  (reward {t['reward']:.3f})")
    return 0
