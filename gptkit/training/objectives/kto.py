"""KTO, Kahneman-Tversky optimization (Ethayarajh et al. 2024, arXiv:2402.01306): objective=kto, on
data=unpaired (gptkit.data.unpaired): single completions, each labelled desirable or undesirable, against a
frozen reference.

For each row, logp = the sum of its completion's log-probs, and r = logp_pi - logp_ref. The reference point
z0 is the KL of the policy to the reference, estimated as TRL 1.16's KTOTrainer estimates it: on mismatched
rows (each row's prompt followed by the completion of the previous row of the micro-step's rows over all
the ranks, data.unpaired: TRL's pairs on one process; TRL pairs within each device's batch instead), with
no gradient,

    z0 = max(0, mean over the micro-batch (and the mean over the ranks, whose shares are equal: the mean
         over the global micro-batch) of (logp_pi - logp_ref) of the mismatched rows)

so z0, and the loss, are the same on any number of ranks sharing the same global batch.

and the loss of a row (the paper's eq. 7-8, TRL's loss_type="kto")

    desirable:    kto.desirable_weight   * (1 - sigmoid(beta (r - z0)))
    undesirable:  kto.undesirable_weight * (1 - sigmoid(beta (z0 - r)))

the micro-batch's loss the mean over its rows. Logged: rewards/desirable and rewards/undesirable (means of
beta r over those rows) and kl (z0's mean over the batches).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gptkit.errors import ConfigError
from gptkit.training.objectives.base import FrozenModel, Objective, frozen_words, target_logps

# train/ and val/ figures: rewards/desirable, rewards/undesirable, kl
KEYS = ("rewards/desirable", "rewards/undesirable", "kl")


def check_kto_config(kto: Any) -> None:
    """The kto block: one-line ConfigErrors for values that cannot train."""
    if kto is None:
        return
    for key, default in (("beta", 0.1), ("desirable_weight", 1.0), ("undesirable_weight", 1.0)):
        v = kto.get(key, default)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < float(v) < 1e6:
            raise ConfigError(f"kto.{key}={v!r} must be > 0")


def reference_point(kl_policy: torch.Tensor, kl_ref: torch.Tensor) -> torch.Tensor:
    """z0: the mean log-ratio of the mismatched rows [N], averaged over the ranks, at least 0, detached."""
    z = (kl_policy - kl_ref).detach().float().mean()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(z)
        z = z / dist.get_world_size()
    return z.clamp(min=0)


def kto_loss(
    policy: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor,
    z0: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss of each row [N], its reward beta r [N], detached) from summed completion log-probs of the policy
    and the reference [N], the labels [N] bool and the reference point z0 (module docstring)."""
    r = policy - ref  # [N]
    good = desirable_weight * (1 - torch.sigmoid(beta * (r - z0)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r)))
    return torch.where(desirable, good, bad), beta * r.detach()


class KTOWindow:
    """Sums since the last read, on the device: desirable rewards and rows, undesirable rewards and rows,
    z0 and batches, losses and rows."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None

    def add(self, rewards, desirable, z0, losses=None) -> None:
        d = desirable.float()
        loss = losses.detach().float().sum() if losses is not None else rewards.new_zeros(())
        row = torch.stack(
            [
                (rewards * d).sum(),
                d.sum(),
                (rewards * (1 - d)).sum(),
                (1 - d).sum(),
                z0.float(),
                torch.ones((), device=rewards.device),
                loss.float(),
                torch.tensor(float(rewards.numel()), device=rewards.device),
            ]
        ).float()
        self.sums = row if self.sums is None else self.sums + row

    def read(self, strategy, prefix: str, losses: bool) -> dict[str, float]:
        if self.sums is None:
            return {}
        sums = self.sums if strategy is None else strategy.reduce(self.sums, reduce_op="sum")
        self.sums = None
        s = sums.tolist()
        out = {}
        if s[1]:
            out[f"{prefix}/rewards/desirable"] = s[0] / s[1]
        if s[3]:
            out[f"{prefix}/rewards/undesirable"] = s[2] / s[3]
        if s[5]:
            out[f"{prefix}/kl"] = s[4] / s[5]
        if losses and s[7]:
            out[f"{prefix}/loss"] = s[6] / s[7]
        return out


class KTO(Objective):
    """objective=kto: the KTO loss of each batch's labelled completions against the frozen reference
    (kto.beta, desirable_weight, undesirable_weight), its reference point from the mismatched rows."""

    name = "kto"
    group = "kto"
    data_kinds = ("unpaired",)
    needs_start = True
    needs_reference = True
    chunked_logps = True

    @classmethod
    def check_config(cls, group: Any) -> None:
        check_kto_config(group)

    @classmethod
    def wrong_data(cls, kind: Any) -> str:
        return (
            f"objective=kto trains on labelled completions, not data kind {kind!r}: add data=unpaired "
            "data.paths=[completions.jsonl] (prompt, completion, label)"
        )

    @classmethod
    def claimed(cls) -> str:
        return (
            "data=unpaired holds labelled completions for KTO: add objective=kto "
            "init_from=<run folder or checkpoint>"
        )

    @classmethod
    def no_start(cls) -> str:
        return (
            "objective=kto needs a starting checkpoint: init_from=<run folder or checkpoint> (e.g. an SFT "
            "run); its weights, frozen, are the reference"
        )

    @classmethod
    def flops(cls, counts: Any, dense: float, causal: float, group: Any = None) -> tuple[float, float]:
        """Training FLOPs per token plus three no-grad forwards: the reference's of the rows, and the policy's
        and the reference's of the mismatched rows."""
        return dense + 3 * counts.forward_dense, causal + 3 * counts.forward_causal

    @classmethod
    def batch_words(cls, batch_size: int, group: Any = None) -> str:
        return f"{batch_size} completions (+ {batch_size} mismatched rows, no grad)"

    @classmethod
    def describe(cls, plan: Any) -> str | None:
        k = plan.cfg.get("kto") or {}
        reference = frozen_words(
            plan,
            "reference",
            "the base with the adapters off (no second copy)"
            if plan.lora
            else "a frozen copy of the starting weights",
        )
        return (
            f"KTO: beta {k.get('beta')}, weights {k.get('desirable_weight')} desirable / "
            f"{k.get('undesirable_weight')} undesirable; reference: {reference}"
        )

    def __init__(self, plan: Any, frozen: dict[str, FrozenModel] | None = None) -> None:
        super().__init__(plan, frozen)
        cfg = self.settings or {}
        self.beta = float(cfg.get("beta", 0.1))
        self.weights = float(cfg.get("desirable_weight", 1.0)), float(cfg.get("undesirable_weight", 1.0))
        self.train_window, self.val_window = KTOWindow(), KTOWindow()

    def row_losses(self, policy: torch.nn.Module, batch):
        """(loss [N], reward [N], labels [N], z0) of a batch (x, y, kl_x, kl_y [N, T], labels [N])."""
        x, y, kl_x, kl_y, labels = batch[:5]
        n = x.shape[0]
        # the reference on the rows and the mismatched rows in one forward
        ref = self.reference.logps(policy, torch.cat([x, kl_x]), torch.cat([y, kl_y])).sum(-1)  # [2N]
        with torch.no_grad():
            kl_policy = target_logps(policy, kl_x, kl_y).sum(-1)  # [N]
        z0 = reference_point(kl_policy, ref[n:])
        pi = target_logps(policy, x, y).sum(-1)  # [N]
        labels = labels.to(pi.device).bool()
        losses, rewards = kto_loss(pi, ref[:n], labels, z0, self.beta, *self.weights)
        return losses, rewards, labels, z0

    def loss(self, model, batch):
        losses, rewards, labels, z0 = self.row_losses(model, batch)
        self.train_window.add(rewards, labels, z0)
        return losses.mean(), None

    def validate(self, model, batch, rank: int, world_size: int, val_sources) -> None:
        """Each val row counted once over the ranks (its index % world == rank), as DPO's pairs."""
        losses, rewards, labels, z0 = self.row_losses(model, batch)
        mine = (batch[5].to(losses.device) % world_size) == rank
        self.val_window.add(rewards[mine], labels[mine], z0, losses[mine])

    def val_metrics(self, strategy, val_sources) -> dict[str, Any]:
        return self.val_window.read(strategy, "val", losses=True)

    def train_metrics(self, strategy) -> dict[str, float]:
        return self.train_window.read(strategy, "train", losses=False)

    def progress(self, metrics: dict[str, float]) -> list[str]:
        if "train/kl" not in metrics:
            return []
        good, bad = metrics.get("train/rewards/desirable"), metrics.get("train/rewards/undesirable")
        parts = [f"kl {metrics['train/kl']:.3g}"]
        parts += [f"reward good {good:.3g}"] if good is not None else []
        parts += [f"bad {bad:.3g}"] if bad is not None else []
        return ["  ".join(parts)]

    def summary(self, metrics: dict[str, Any]) -> str | None:
        val = metrics.get("val/loss")
        return None if val is None else f"val KTO loss {float(val):.4f}"
