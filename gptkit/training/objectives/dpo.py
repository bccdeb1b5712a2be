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
    ipo:      (h - 1 / (2 beta))^2,  h = (logp_pi - logp_ref)_chosen / |chosen|
                                      - (logp_pi - logp_ref)_rejected / |rejected|
              (Azar et al. 2023, arXiv:2310.12036, eq. 17; the log-ratios per answer token, as TRL 1.16's
              loss_type="ipo", which its authors confirmed is the paper's form)

and two losses without a reference (none is built or held), on the length-normalized log-probs
avg = logp_pi / |answer| (|answer|: its loss tokens):

    simpo:    -log sigmoid(beta avg_chosen - beta avg_rejected - gamma)      (Meng et al. 2024, SimPO,
              arXiv:2405.14734, eq. 6; dpo.gamma the target margin; with label_smoothing as cDPO's; TRL's
              CPOTrainer with loss_type="simpo", simpo_gamma=gamma, cpo_alpha=0)
    orpo:     -avg_chosen - lambda log sigmoid(log odds_chosen - log odds_rejected),
              odds = exp(avg) / (1 - exp(avg))                               (Hong et al. 2024, ORPO,
              arXiv:2403.07691, eq. 6-7: the SFT loss of the chosen answer, a token mean, plus the odds-ratio
              term with dpo.lambda; TRL's ORPOTrainer with beta=lambda)

and the batch's loss is the mean over its pairs. Logged (train at log steps, val at validation):
rewards/chosen, rewards/rejected (means of r), rewards/margin (mean of their difference) and rewards/accuracy
(share of pairs with r_chosen > r_rejected); without a reference r = beta avg (simpo) or lambda avg (orpo),
as TRL logs them.

By default (dpo.reference=live) the reference log-probs are computed in the step, one no-grad forward of the
reference per batch (about a third of a training step's FLOPs): nothing to store or recompute when the data
or seq_len changes. dpo.reference=precomputed reads them from the prepared data instead (`gptkit prepare
... reference=<run>`, gptkit/training/precompute.py: the same target_logps, summed, stored in fp32 per row):
no reference model is built or held, and a run refuses outputs of another model, tokenizer or row layout.
With finetune=lora the live reference is the policy itself with its adapters switched off (no second copy
of the weights in memory).

Every log-prob (the policy's and the reference's) comes from target_logps: the model computes them chunk by
chunk over the tokens, never holding the [2P, T, vocab] fp32 logits in the forward or the backward pass
(base.py, docs/dpo.md's memory section).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from gptkit.errors import ConfigError
from gptkit.training.objectives.base import FrozenModel, Objective, frozen_words, target_logps

LOSSES = ("sigmoid", "hinge", "ipo", "simpo", "orpo")
# the losses of the policy's log-probs alone: no reference is built for them
REFERENCE_FREE = ("simpo", "orpo")
# the losses dpo.label_smoothing applies to
SMOOTHED = ("sigmoid", "simpo")
REWARD_KEYS = ("chosen", "rejected", "margin", "accuracy")
# dpo.reference: live (the frozen reference runs in every step) | precomputed (its log-probs read from the
# prepared data: gptkit prepare ... reference=<run>; no reference model is built or held)
REFERENCES = ("live", "precomputed")


def precomputed_reference(dpo: Any) -> bool:
    """dpo.reference=precomputed with a loss that reads a reference."""
    return dpo is not None and str(dpo.get("reference", "live")) == "precomputed"


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
    loss = str(dpo.get("loss", "sigmoid"))
    if loss not in LOSSES:
        raise ConfigError(f"dpo.loss={dpo.get('loss')!r} is not one of {', '.join(LOSSES)}")
    reference = dpo.get("reference", "live")
    if reference not in REFERENCES:
        raise ConfigError(f"dpo.reference={reference!r} is not one of {', '.join(REFERENCES)}")
    if reference == "precomputed" and loss in REFERENCE_FREE:
        raise ConfigError(
            f"dpo.reference=precomputed: dpo.loss={loss} reads no reference; drop dpo.reference"
        )
    if loss not in SMOOTHED and smoothing:
        raise ConfigError(
            f"dpo.label_smoothing applies to dpo.loss={' or '.join(SMOOTHED)} only; set it to 0 for {loss}"
        )
    gamma = dpo.get("gamma", 0.5)
    if not isinstance(gamma, (int, float)) or isinstance(gamma, bool) or not 0 <= float(gamma) < 1e3:
        raise ConfigError(f"dpo.gamma={gamma!r} must be >= 0 (simpo's target reward margin; 0.5 is TRL's)")
    lam = dpo.get("lambda", 0.1)
    if not isinstance(lam, (int, float)) or isinstance(lam, bool) or not 0 < float(lam) < 1e3:
        raise ConfigError(
            f"dpo.lambda={lam!r} must be > 0 (orpo's weight of the odds-ratio term; 0.1 is usual)"
        )


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss: str = "sigmoid",
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss of each pair [P], chosen rewards [P], rejected rewards [P]) from summed answer log-probs [P]
    (see the module docstring; ipo also reads the answers' loss-token counts [P]). The rewards are detached:
    they are measured, not trained."""
    chosen = policy_chosen - ref_chosen  # [P] log-ratio of the chosen answer
    rejected = policy_rejected - ref_rejected  # [P]
    z = beta * (chosen - rejected)  # [P] the reward margin
    if loss == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    elif loss == "hinge":
        losses = torch.relu(1.0 - z)
    elif loss == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("ipo needs the answers' token counts")
        h = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)  # [P]
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ConfigError(f"dpo.loss={loss!r} is not one of {', '.join(LOSSES)}")
    return losses, beta * chosen.detach(), beta * rejected.detach()


def simpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO: (loss of each pair [P], chosen rewards beta avg [P], rejected rewards [P]) from summed answer
    log-probs [P] and the answers' loss-token counts [P]; no reference (module docstring)."""
    chosen = beta * policy_chosen / chosen_tokens.clamp(min=1)  # [P] the length-normalized reward
    rejected = beta * policy_rejected / rejected_tokens.clamp(min=1)  # [P]
    z = chosen - rejected - gamma  # [P]
    losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return losses, chosen.detach(), rejected.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation: log(-expm1(x)) near 0, log1p(-exp(x)) below -ln 2
    (Maechler 2012)."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO: (loss of each pair [P]: the chosen answer's NLL per token plus lam times the odds-ratio term,
    chosen rewards lam avg [P], rejected rewards [P]) from summed answer log-probs [P] and the answers'
    loss-token counts [P]; no reference (module docstring)."""
    chosen = policy_chosen / chosen_tokens.clamp(min=1)  # [P] mean log-prob per token, < 0
    rejected = policy_rejected / rejected_tokens.clamp(min=1)  # [P]
    # log odds(chosen) - log odds(rejected), odds = p / (1 - p)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))  # [P]
    losses = -chosen - lam * F.logsigmoid(log_odds)
    return losses, lam * chosen.detach(), lam * rejected.detach()


def answer_tokens(targets: torch.Tensor) -> torch.Tensor:
    """Each row's loss tokens: targets [N, T] (-100: not counted) -> [N] fp32."""
    return (targets != -100).sum(-1).float()


def answer_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed log-probs of each row's targets: logits [N, T, vocab_size], targets [N, T] (-100: not
    counted) -> [N] in fp32. From whole logits (gptkit bench dpo, the tests' unchunked reference); the
    objectives sum target_logps instead, chunked."""
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
    chunked_logps = True

    @classmethod
    def check_config(cls, group: Any) -> None:
        check_dpo_config(group)

    @classmethod
    def uses_reference(cls, group: Any) -> bool:
        """Every loss but the reference-free ones (simpo, orpo) measures against the frozen reference, which
        runs in the step unless its log-probs are precomputed (dpo.reference=precomputed: no forward, no
        weights held)."""
        if precomputed_reference(group):
            return False
        return group is None or str(group.get("loss", "sigmoid")) not in REFERENCE_FREE

    @classmethod
    def precomputed_models(cls, group: Any) -> tuple[str, ...]:
        return ("reference",) if precomputed_reference(group) else ()

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
        loss = str(d.get("loss", "sigmoid"))
        if loss == "simpo":
            return f"DPO: SimPO loss, beta {d.get('beta')}, gamma {d.get('gamma', 0.5)}; no reference"
        if loss == "orpo":
            return f"DPO: ORPO loss (SFT + odds ratio), lambda {d.get('lambda', 0.1)}; no reference"
        reference = frozen_words(
            plan,
            "reference",
            "the base with the adapters off (no second copy)"
            if plan.lora
            else "a frozen copy of the starting weights",
        )
        if precomputed_reference(d):
            reference = "precomputed log-probs in the data (no reference model held)"
        return f"DPO: beta {d.get('beta')}, {d.get('loss')} loss; reference: {reference}"

    def __init__(self, plan: Any, frozen: dict[str, FrozenModel] | None = None) -> None:
        super().__init__(plan, frozen)
        cfg = self.settings or {}
        self.beta = float(cfg.get("beta", 0.1))
        self.label_smoothing = float(cfg.get("label_smoothing", 0.0))
        self.loss_type = str(cfg.get("loss", "sigmoid"))
        self.gamma = float(cfg.get("gamma", 0.5))
        self.lam = float(cfg.get("lambda", 0.1))
        # the reference's log-probs come last in every batch (gptkit.data.preference.PairRows.ref)
        self.precomputed = precomputed_reference(self.settings)
        self.train_rewards = RewardWindow()
        self.val_rewards = RewardWindow()

    def pair_losses(self, policy: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss [P], chosen reward [P], rejected reward [P]) of a batch of pairs (x, y [2P, T]: chosen rows
        even, rejected odd)."""
        # [2P, T] each
        x, y = batch[0], batch[1]
        n = answer_tokens(y).view(-1, 2)  # [P, 2]: chosen, rejected
        if self.loss_type == "simpo":
            pi = target_logps(policy, x, y).sum(-1).view(-1, 2)  # [P, 2]
            return simpo_loss(
                pi[:, 0], pi[:, 1], n[:, 0], n[:, 1], self.beta, self.gamma, self.label_smoothing
            )
        if self.loss_type == "orpo":
            pi = target_logps(policy, x, y).sum(-1).view(-1, 2)  # [P, 2]
            return orpo_loss(pi[:, 0], pi[:, 1], n[:, 0], n[:, 1], self.lam)
        # [P, 2]: chosen, rejected
        if self.precomputed:
            ref = batch[-1].to(device=x.device, dtype=torch.float32).view(-1, 2)
        else:
            ref = self.reference.logps(policy, x, y).sum(-1).view(-1, 2)
        pi = target_logps(policy, x, y).sum(-1).view(-1, 2)  # [P, 2]
        return dpo_loss(
            pi[:, 0],
            pi[:, 1],
            ref[:, 0],
            ref[:, 1],
            self.beta,
            self.label_smoothing,
            self.loss_type,
            n[:, 0],
            n[:, 1],
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
        name = {"simpo": "SimPO", "orpo": "ORPO", "ipo": "IPO"}.get(self.loss_type, "DPO")
        return f"val {name} loss {float(val):.4f} (reward accuracy {float(accuracy):.1%})"
