"""DPO, direct preference optimization (Rafailov et al. 2023, arXiv:2305.18290): objective=dpo.

A batch holds pairs: rows 2i and 2i+1 are the chosen and the rejected answer to the same prompt
(gptkit.data.preference), targets -100 outside the answer. For each answer

    logp = sum over the answer's tokens of log p(token | everything before it)

under the policy (the model being trained, pi) and under the reference (ref: the starting weights, frozen,
in eval mode, no grad). With the implicit rewards r = beta * (logp_pi - logp_ref), the loss of a pair is

    sigmoid:  -log sigmoid(r_chosen - r_rejected)                      (the paper's eq. 7)
              with dpo.label_smoothing = e > 0 (conservative DPO, cDPO: labels flipped with probability e):
              -(1 - e) log sigmoid(z) - e log sigmoid(-z),  z = r_chosen - r_rejected
              (TRL 1.16's sigmoid loss has no smoothing; its "robust" loss is another, unbiased variant)
    hinge:    max(0, 1 - z)                                             (SLiC-HF, TRL's loss_type="hinge")

and the batch's loss is the mean over its pairs. Logged (train at log steps, val at validation):
rewards/chosen, rewards/rejected (means of r), rewards/margin (mean of z) and rewards/accuracy (share of
pairs with r_chosen > r_rejected).

The reference log-probs are computed in the step, one no-grad forward of the reference per batch (about a
third of a training step's FLOPs), rather than precomputed once over the data: nothing to store, keep
in step with a resume, or recompute when the data, seq_len or world size changes, and the reference is the
same code path under DDP and FSDP2. With finetune=lora the reference is the policy itself with its
adapters switched off (no second copy of the weights in memory).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gptkit.errors import ConfigError
from gptkit.training.objectives.base import FrozenModel, Objective, frozen_words

LOSSES = ("sigmoid", "hinge")
REWARD_KEYS = ("chosen", "rejected", "margin", "accuracy")


def check_dpo_config(dpo: Any) -> None:
    """The dpo block: one-line ConfigErrors for values that cannot train."""
    if dpo is None:
        return
    beta = float(dpo.get("beta", 0.1))
    if not beta > 0:
        raise ConfigError(
            f"dpo.beta={dpo.get('beta')} must be > 0 (the strength of the pull towards the "
            "reference; 0.1 is usual)"
        )
    smoothing = float(dpo.get("label_smoothing", 0.0))
    if not 0.0 <= smoothing < 0.5:
        raise ConfigError(
            f"dpo.label_smoothing={smoothing} must be in [0, 0.5) (the assumed share of "
            "flipped preference labels)"
        )
    if str(dpo.get("loss", "sigmoid")) not in LOSSES:
        raise ConfigError(f"dpo.loss={dpo.get('loss')!r} is not one of {', '.join(LOSSES)}")
    if str(dpo.get("loss", "sigmoid")) == "hinge" and smoothing:
        raise ConfigError("dpo.label_smoothing applies to dpo.loss=sigmoid only; set it to 0 for hinge")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss of each pair [P], chosen rewards [P], rejected rewards [P]) from summed answer log-probs [P]
    (see the module docstring). The rewards are detached: they are measured, not trained."""
    chosen = policy_chosen - ref_chosen  # [P] log-ratio of the chosen answer
    rejected = policy_rejected - ref_rejected  # [P]
    z = beta * (chosen - rejected)  # [P] the reward margin
    if loss == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    elif loss == "hinge":
        losses = torch.relu(1.0 - z)
    else:
        raise ConfigError(f"dpo.loss={loss!r} is not one of {', '.join(LOSSES)}")
    return losses, beta * chosen.detach(), beta * rejected.detach()


def answer_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed log-probs of each row's targets: logits [N, T, vocab_size], targets [N, T] (-100: not
    counted) -> [N] in fp32."""
    n, t, v = logits.shape
    token = -F.cross_entropy(
        logits.float().reshape(n * t, v), targets.reshape(n * t), ignore_index=-100, reduction="none"
    )  # [N * T], 0 where ignored
    return token.view(n, t).sum(-1)  # [N]


def reward_stats(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """[4] sums over the pairs of (chosen reward, rejected reward, margin, chosen > rejected): what the
    RewardWindow adds up; divided by the pair count they are the REWARD_KEYS."""
    return torch.stack(
        [chosen.sum(), rejected.sum(), (chosen - rejected).sum(), (chosen > rejected).float().sum()]
    )


class RewardWindow:
    """Reward sums (and, for validation, loss sums) and the pair count since the last read, on the device (no
    host sync until read)."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # [6]: REWARD_KEYS sums, loss sum, pairs
        # whether add() was given the losses (validation): read() then gives their mean
        self.losses = False

    def add(self, chosen: torch.Tensor, rejected: torch.Tensor, losses: torch.Tensor | None = None) -> None:
        """Add one batch's rewards ([P] each) and, when given, its pairs' losses [P]."""
        self.losses = self.losses or losses is not None
        zero = chosen.new_zeros((), dtype=torch.float32)
        loss = losses.detach().float().sum() if losses is not None else zero
        row = torch.cat(
            [
                reward_stats(chosen.float(), rejected.float()),
                loss.view(1),
                torch.tensor([float(chosen.numel())], dtype=torch.float32, device=chosen.device),
            ]
        )
        self.sums = row if self.sums is None else self.sums + row

    def read(self, strategy, prefix: str) -> dict[str, float]:
        """{prefix/rewards/<key>: mean over every pair of every rank, and prefix/loss when losses were added}
        (one host sync), then start afresh."""
        if self.sums is None:
            return {}
        sums = self.sums if strategy is None else strategy.reduce(self.sums, reduce_op="sum")
        self.sums = None
        pairs = float(sums[-1])
        if not pairs:
            return {}
        out = {f"{prefix}/rewards/{k}": float(s) / pairs for k, s in zip(REWARD_KEYS, sums[:4].tolist())}
        return {f"{prefix}/loss": float(sums[4]) / pairs, **out} if self.losses else out


class DPO(Objective):
    """objective=dpo: the DPO loss of each batch's pairs against the frozen reference (dpo.beta,
    label_smoothing, loss), and the reward windows of train and validation."""

    name = "dpo"
    group = "dpo"
    data_kinds = ("preference",)
    needs_start = True
    needs_reference = True
    rows_per_item = 2

    @classmethod
    def check_config(cls, group: Any) -> None:
        check_dpo_config(group)

    @classmethod
    def wrong_data(cls, kind: Any) -> str:
        return (
            f"objective=dpo trains on preference pairs, not data kind {kind!r}: add data=preference "
            "data.paths=[pairs.jsonl] (prompt, chosen, rejected)"
        )

    @classmethod
    def claimed(cls) -> str:
        return (
            "data=preference holds preference pairs for DPO: add objective=dpo "
            "init_from=<run folder or checkpoint>"
        )

    @classmethod
    def no_start(cls) -> str:
        return (
            "objective=dpo needs a starting checkpoint: init_from=<run folder or checkpoint> (e.g. an SFT "
            "run); its weights, frozen, are the reference"
        )

    @classmethod
    def batch_words(cls, batch_size: int, group: Any = None) -> str:
        return f"{batch_size} pairs x 2 answers"

    @classmethod
    def describe(cls, plan: Any) -> str | None:
        d = plan.cfg.get("dpo") or {}
        reference = frozen_words(
            plan,
            "reference",
            "the base with the adapters off (no second copy)"
            if plan.lora
            else "a frozen copy of the starting weights",
        )
        return f"DPO: beta {d.get('beta')}, {d.get('loss')} loss; reference: {reference}"

    def __init__(self, plan: Any, frozen: dict[str, FrozenModel] | None = None) -> None:
        super().__init__(plan, frozen)
        cfg = self.settings or {}
        self.beta = float(cfg.get("beta", 0.1))
        self.label_smoothing = float(cfg.get("label_smoothing", 0.0))
        self.loss_type = str(cfg.get("loss", "sigmoid"))
        self.train_rewards = RewardWindow()
        self.val_rewards = RewardWindow()

    def pair_losses(self, policy: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss [P], chosen reward [P], rejected reward [P]) of a batch of pairs (x, y [2P, T]: chosen rows
        even, rejected odd)."""
        # [2P, T] each
        x, y = batch[0], batch[1]
        # [P, 2]: chosen, rejected
        ref = answer_logps(self.reference.logits(policy, x), y).view(-1, 2)
        pi = answer_logps(policy(x).logits, y).view(-1, 2)  # [P, 2]
        return dpo_loss(
            pi[:, 0], pi[:, 1], ref[:, 0], ref[:, 1], self.beta, self.label_smoothing, self.loss_type
        )

    def loss(self, model, batch):
        """The mean DPO loss of a batch of pairs (every micro-batch holds as many pairs: no token weight);
        its rewards added to the train window."""
        losses, chosen, rejected = self.pair_losses(model, batch)
        self.train_rewards.add(chosen, rejected)
        return losses.mean(), None

    def validate(self, model, batch, rank: int, world_size: int, val_sources) -> None:
        """Add a validation batch's pair losses and rewards to val_rewards, each pair counted once over the
        ranks: the batch's last element holds each pair's index in the val set [P], and pair i counts on rank
        i % world (where DistributedSampler puts it first; its padding repeats land elsewhere). So val/loss
        and val/rewards/* are the means over the distinct val pairs, as one process computes them."""
        losses, chosen, rejected = self.pair_losses(model, batch)
        mine = (batch[2].to(losses.device) % world_size) == rank  # [P]
        self.val_rewards.add(chosen[mine], rejected[mine], losses[mine])

    def val_metrics(self, strategy, val_sources) -> dict[str, Any]:
        return self.val_rewards.read(strategy, "val")

    def train_metrics(self, strategy) -> dict[str, float]:
        return self.train_rewards.read(strategy, "train")

    def progress(self, metrics: dict[str, float]) -> list[str]:
        if "train/rewards/accuracy" not in metrics:
            return []
        return [
            f"reward acc {metrics['train/rewards/accuracy']:.0%} margin {metrics['train/rewards/margin']:.3g}"
        ]

    def val_progress(self, metrics: dict[str, Any]) -> str:
        accuracy = metrics.get("val/rewards/accuracy")
        return "" if accuracy is None else f"  val reward acc {float(accuracy):.1%}"

    def summary(self, metrics: dict[str, Any]) -> str | None:
        val, accuracy = metrics.get("val/loss"), metrics.get("val/rewards/accuracy")
        if val is None or accuracy is None:
            return super().summary(metrics)
        return f"val DPO loss {float(val):.4f} (reward accuracy {float(accuracy):.1%})"
