"""Reward models (a Bradley-Terry scalar head on preference pairs): objective=reward.

The model gains a score head (model.score_head: `score`, a Linear(d_model, 1) without bias, as transformers'
*ForSequenceClassification has it; gptkit/model/gpt.py) that reads the final-normed hidden state of a
sequence's last token. On data=preference (rows 2i and 2i + 1 the chosen and the rejected answer of pair i,
targets -100 outside the answer; gptkit.data.preference) the reward of each answer is

    r = score(h_last),  h_last the hidden state at the answer's last token (its end of turn) in the input row,
                        or at the row's last input when the answer fills the row

and the loss of a pair is the Bradley-Terry negative log-likelihood of the preference

    -log sigmoid(r_chosen - r_rejected) + c (r_chosen + r_rejected)^2

(c: reward.center_rewards_coefficient, TRL's term that keeps rewards centred on 0; 0 leaves it out), the
batch's loss their mean, TRL 1.16's RewardTrainer's. Logged as DPO's (train at log steps, val at
validation): rewards/chosen, rewards/rejected, rewards/margin and rewards/accuracy (share of pairs with
r_chosen > r_rejected: on the val pairs, the held-out accuracy).

The run starts from weights (init_from=, e.g. an SFT run: its chat template renders the pairs); the head
starts at N(0, model.init_std), every other weight trains with it (finetune=full), or the adapters do
(finetune=lora, qlora: the head trains in full beside them and their checkpoints hold it, as PEFT's
modules_to_save; gptkit.adapters.WHOLE). A run whose model has a score head is a reward model: `gptkit
sample`, `chat`, `serve` and init_from= of another objective refuse it in one line; `gptkit export` writes
it as transformers' *ForSequenceClassification, and objective=grpo reads it as a reward ({kind: model,
path: <run>}).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from gptkit.errors import ConfigError
from gptkit.training.objectives.base import FrozenModel
from gptkit.training.objectives.dpo import DPO, RewardWindow

KEYS = ("center_rewards_coefficient",)


def check_reward_config(group: Any) -> None:
    """The reward block: one-line ConfigErrors for values that cannot train."""
    if group is None:
        return
    unknown = sorted(set(group) - set(KEYS))
    if unknown:
        raise ConfigError(f"reward has unknown key(s) {', '.join(unknown)}; keys: {', '.join(KEYS)}")
    c = group.get("center_rewards_coefficient")
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= float(c) < 1e3):
        raise ConfigError(
            f"reward.center_rewards_coefficient={c!r} must be null or >= 0 (TRL suggests 0.01; 0: off)"
        )


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, center: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss of each pair [P], chosen rewards [P], rejected rewards [P], detached) from the rewards [P]:
    -log sigmoid(r_c - r_r) + center (r_c + r_r)^2 (module docstring)."""
    losses = -F.logsigmoid(chosen - rejected)
    if center:
        losses = losses + center * (chosen + rejected) ** 2
    return losses, chosen.detach(), rejected.detach()


def last_positions(y: torch.Tensor) -> torch.Tensor:
    """Each row's position in the input whose hidden state the head reads: targets [N, T] (-100 outside the
    answer) -> [N] int64, the answer's last token (the input holds it one place after its target), or T - 1
    when the answer fills the row."""
    t = y.shape[1]
    idx = torch.arange(t, device=y.device).expand_as(y)
    last = torch.where(y != -100, idx, torch.full_like(idx, -1)).max(-1).values  # [N]
    return (last + 1).clamp(max=t - 1)


class Reward(DPO):
    """objective=reward: the Bradley-Terry loss of a scalar head on each batch's pairs; DPO's data, batches,
    reward windows and validation (each val pair counted once over the ranks), no reference."""

    name = "reward"
    group = "reward"
    needs_reference = False

    @classmethod
    def check_config(cls, group: Any) -> None:
        check_reward_config(group)

    @classmethod
    def uses_reference(cls, group: Any) -> bool:
        return False

    @classmethod
    def model_config(cls, model: Any, source: str) -> Any:
        """The model with its score head (model.score_head): added to a policy's, kept in a reward run's."""
        return model if model.score_head else dataclasses.replace(model, score_head=True)

    @classmethod
    def wrong_data(cls, kind: Any) -> str:
        return (
            f"objective=reward trains on preference pairs, not data kind {kind!r}: add data=preference "
            "data.paths=[pairs.jsonl] (prompt, chosen, rejected)"
        )

    @classmethod
    def no_start(cls) -> str:
        return (
            "objective=reward needs a starting checkpoint: init_from=<run folder or checkpoint> (e.g. an SFT "
            "run); the score head is added to its model"
        )

    @classmethod
    def describe(cls, plan: Any) -> str | None:
        c = float((plan.cfg.get("reward") or {}).get("center_rewards_coefficient") or 0.0)
        center = f", centring {c:g} (r_c + r_r)^2" if c else ""
        return f"reward model: Bradley-Terry loss -log sigmoid(r_chosen - r_rejected){center}; no reference"

    def __init__(self, plan: Any, frozen: dict[str, FrozenModel] | None = None) -> None:
        super().__init__(plan, frozen)
        self.center = float((self.settings or {}).get("center_rewards_coefficient") or 0.0)
        self.train_rewards = RewardWindow()
        self.val_rewards = RewardWindow()

    def pair_losses(self, policy: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss [P], chosen reward [P], rejected reward [P]) of a batch of pairs (x, y [2P, T]: chosen rows
        even, rejected odd)."""
        x, y = batch[0], batch[1]  # [2P, T] each
        r = policy(x, score_at=last_positions(y)).scores.view(-1, 2)  # [P, 2]: chosen, rejected
        return bradley_terry_loss(r[:, 0], r[:, 1], self.center)

    def summary(self, metrics: dict[str, Any]) -> str | None:
        val, accuracy = metrics.get("val/loss"), metrics.get("val/rewards/accuracy")
        if val is None or accuracy is None:
            return super().summary(metrics)
        margin = metrics.get("val/rewards/margin")
        return (
            f"val reward-model loss {float(val):.4f} (held-out accuracy {float(accuracy):.1%}, "
            f"margin {float(margin):.3g})"
        )
