"""objective=grpo with an environment (grpo.environment=module:Class): each completion of a group is a
multi-turn episode (gptkit/inference/episodes.py), its reward the environment's (turn rewards + the score of
the finished episode), its training row the episode rendered as an SFT record, the assistant's turns in the
loss and the tools' results masked from it.

    grpo.environment   module:Class or file.py:Class (gptkit/inference/environment.py: the contract)
    grpo.max_turns     model turns per episode (a turn's calls run, their results in the context, and the
                       model answers again; the last turn's calls are not run)

Episode r of the prompt at place s of the step's global batch draws turn k with the key (key(seed,
micro-step, s, r), k): a resumed step, and a run on another number of processes, plays the same episodes.
Each rank appends its episodes to <run>/episodes/rank<r>.jsonl (its micro-step, place, turns, calls, results,
rewards, error), which `gptkit trace` shows per step. A tool that raises ends its episode (the error is the
tool's message and the record's `error`), counted in train/episode_errors; the run goes on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from gptkit.chat_templates import load_template_file
from gptkit.data.prompts import PromptBatch
from gptkit.data.records import prompt_conversation
from gptkit.errors import ConfigError, GptkitError
from gptkit.inference.environment import load_environment
from gptkit.inference.episodes import CONTEXT, LENGTH, TOOL_ERROR, EpisodeContext, run_episodes
from gptkit.inference.rollouts import RolloutOptions, sample_key
from gptkit.training.rewards import Reward, Rewards, parse_rewards

EPISODES_DIR = "episodes"
# the reward parts of an episode, as the logs name them (train/rewards/score, train/rewards/turns)
PARTS = ("score", "turns")


def check_environment(cfg: Any) -> None:
    """grpo.environment loaded (and announced) before anything is written; its settings checked."""
    g = cfg.grpo
    spec = g.get("environment")
    if not spec:
        return
    max_turns = g.get("max_turns")
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ConfigError(f"grpo.max_turns={max_turns!r} must be an integer >= 1")
    if [r.kind for r in parse_rewards(g.get("rewards")).rewards] != ["exact"]:
        raise ConfigError(
            "grpo.rewards and grpo.environment: an episode's reward is the environment's (its score and turn "
            "rewards); leave grpo.rewards at its default"
        )
    if int(g.get("val_samples") or 1) > 1:
        raise ConfigError("grpo.val_samples > 1 (pass@k of checkers) does not apply to grpo.environment")
    load_environment(spec)


def environment_rewards(spec: str) -> Rewards:
    """What the logs and the figures call an episode's reward parts."""
    return Rewards([Reward(name, 1.0, function=str(spec), fn=lambda *a: 0.0) for name in PARTS])


class EpisodeRollouts:
    """A GRPO run's episodes: played, scored, turned into rows, counted and logged."""

    def __init__(self, plan: Any, settings: Any, tokenizer, opts: RolloutOptions) -> None:
        env = load_environment(settings.environment, announce=False)
        template = load_template_file(Path(plan.data.template_path))
        syntax = template.call_syntax()
        if syntax is None:
            raise ConfigError(
                f"grpo.environment: the chat template {template.name} writes no tool call that gptkit can "
                'read back (no JSON call object such as {"name": ..., "arguments": ...})'
            )
        self.ctx = EpisodeContext(tokenizer, template, syntax, env)
        self.max_turns = int(settings.max_turns)
        self.opts, self.seed = opts, int(plan.cfg.seed)
        self.seq_len = int(plan.seq_len)
        self.data = plan.data.settings
        self.run_dir = Path(plan.run_dir) if plan.run_dir is not None else None
        self.reset()

    def reset(self) -> None:
        # train and val: episodes, turns, tool errors, retokenized turns, ended without room, cut turns
        self.sums = {"train": [0.0] * 6, "val": [0.0] * 6}

    def play(self, model, batch: PromptBatch, n: int, temperature: float, step: int, lockstep) -> tuple:
        """Per prompt its n episodes (played with the keys of the module docstring), and the seconds."""
        if lockstep is not None:
            raise GptkitError(
                "grpo.environment plays episodes of their own lengths on each rank, which FSDP2's "
                "collective forwards cannot follow; use one process or DDP"
            )
        opts = RolloutOptions(
            self.opts.max_new_tokens, temperature, self.opts.top_k, self.opts.top_p, self.opts.stop_ids
        )
        prompts = [
            (list(prompt_conversation(row, where, self.data, "", "a prompt record")), row)
            for row, where in zip(batch.rows, batch.where)
        ]
        keys = [[sample_key(self.seed, step, s, r) for r in range(n)] for s in batch.slots.tolist()]
        t = time.perf_counter()
        groups = run_episodes(model, self.ctx, prompts, keys, self.max_turns, opts, self.seq_len)
        return groups, time.perf_counter() - t

    def scores(self, groups) -> tuple[list, list]:
        """(scores[p][i] = [score, turn rewards], totals[p][i])."""
        scores = [[[e.score, e.reward - e.score] for e in g] for g in groups]
        return scores, [[e.reward for e in g] for g in groups]

    def rows(self, groups, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) [N, T]: each episode's rendered ids (at most seq_len + 1), y the next id where the record's
        mask marks it (the assistant's turns), else -100."""
        eps = [e for g in groups for e in g]
        n = max(min(len(e.ids), self.seq_len + 1) for e in eps)
        x = torch.full((len(eps), n - 1), pad, dtype=torch.long)  # [N, T]
        y = torch.full((len(eps), n - 1), -100, dtype=torch.long)  # [N, T]
        for i, e in enumerate(eps):
            ids, mask = e.ids[: self.seq_len + 1], e.mask[: self.seq_len + 1]
            x[i, : len(ids) - 1] = torch.tensor(ids[:-1], dtype=torch.long)
            nxt = torch.tensor(ids[1:], dtype=torch.long)
            y[i, : len(ids) - 1] = torch.where(torch.tensor(mask[1:], dtype=torch.bool), nxt, -100)
        return x, y

    def count(self, groups, split: str = "train") -> tuple[list[int], int]:
        """Add the episodes to the window's counts; (each episode's trained tokens, episodes cut)."""
        eps = [e for g in groups for e in g]
        s = self.sums[split]
        s[0] += len(eps)
        s[1] += sum(len(e.turns) for e in eps)
        s[2] += sum(e.stop == TOOL_ERROR for e in eps)
        s[3] += sum(t.retokenized for e in eps for t in e.turns)
        s[4] += sum(e.stop == CONTEXT for e in eps)
        s[5] += sum(e.stop == LENGTH for e in eps)
        return [sum(e.mask) for e in eps], sum(e.stop == LENGTH for e in eps)

    def metrics(self, strategy, device, prefix: str) -> dict[str, float]:
        sums = torch.tensor(self.sums[prefix], dtype=torch.float64, device=device)
        if strategy is not None:
            sums = strategy.reduce(sums, reduce_op="sum")
        self.sums[prefix] = [0.0] * 6
        n, turns, errors, retok, context, _ = sums.tolist()
        if not n:
            return {}
        return {
            f"{prefix}/episode_turns": turns / n,
            f"{prefix}/episode_errors": errors,
            f"{prefix}/turns_retokenized": retok / max(1.0, turns),
            f"{prefix}/episodes_out_of_context": context / n,
        }

    def log(self, groups, batch: PromptBatch, step: int, rank: int) -> None:
        """Append the episodes to <run>/episodes/rank<rank>.jsonl (what `gptkit trace` shows)."""
        if self.run_dir is None:
            return
        folder = self.run_dir / EPISODES_DIR
        folder.mkdir(parents=True, exist_ok=True)
        lines = []
        for slot, where, g in zip(batch.slots.tolist(), batch.where, groups):
            for r, e in enumerate(g):
                row = {"micro_step": step, "slot": slot, "sample": r, "where": where, **e.to_dict()}
                lines.append(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        with open(folder / f"rank{rank}.jsonl", "a", encoding="utf-8") as f:
            f.write("".join(lines))


def read_episodes(run_dir: Path, micro_step: int, rank: int) -> list[dict]:
    """The episodes a rank played in a micro-step (the last written of each, a resumed step's included)."""
    path = Path(run_dir) / EPISODES_DIR / f"rank{rank}.jsonl"
    if not path.is_file():
        return []
    found: dict[tuple[int, int], dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                # a line cut by a kill mid-write
                continue
            if row.get("micro_step") == micro_step:
                found[(row["slot"], row["sample"])] = row
    return [found[k] for k in sorted(found)]
