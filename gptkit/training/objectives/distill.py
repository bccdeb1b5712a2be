"""Offline knowledge distillation from a frozen teacher: objective=distill (docs/distillation.md).

The teacher is the objective seam's second model, frozen.teacher (a run, a checkpoint, latest, an import or
hf:; any size, the student's tokenizer: gptkit/training/start.py resolve_frozen refuses another vocabulary in
one line). Each step runs the teacher (eval mode, no grad) on the student's own batch, and at every position
that carries a label (targets != -100: packed and padded rows, chat's prompts, count nothing) the student's
next-token distribution s and the teacher's t, both at temperature tau (softmax(logits / tau)), give

    beta = 0        D = KL(t || s) = sum_v t_v (log t_v - log s_v)           forward KL
    beta = 1        D = KL(s || t) = sum_v s_v (log s_v - log t_v)           reverse KL
    0 < beta < 1    D = beta KL(t || m) + (1 - beta) KL(s || m),  m = beta t + (1 - beta) s
                                                                             generalized JSD

(Agarwal et al. 2024, GKD, arXiv:2306.13649, eq. 1; exactly TRL 1.16's GKDTrainer.generalized_jsd_loss,
beta = 0 and 1 its special cases, no tau^2 factor). The loss is

    alpha * CE(student, labels) + (1 - alpha) * D

both the mean over the micro-batch's label positions (CE at temperature 1), weighed by their count as
objective=lm's loss is. A step computes it with chunked_distill_loss, from both models' hidden states and
heads chunk by chunk over the label positions (gptkit_kernels.linear_distill: no [B, T, vocab] logits in
either pass); distill_loss, on whole logits, is the readable reference the tests hold it to.
Validation is objective=lm's: the student's cross-entropy on the labels (val/loss), so
a distilled run and a run on labels alone compare on the same figure; the train row adds train/distill/ce and
train/distill/divergence at log steps.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from gptkit.errors import ConfigError
from gptkit.model import fused
from gptkit.training.objectives.base import FrozenModel, frozen_words
from gptkit.training.objectives.distill_topk import chunked_topk_distill_loss
from gptkit.training.objectives.lm import LM
from gptkit.training.token_mean import loss_tokens


def number(group: Any, key: str, default: float, prefix: str = "distill") -> float:
    value = group.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ConfigError(f"{prefix}.{key}={value!r} must be a number")
    return float(value)


# distill.teacher: live (the teacher runs in every step) | precomputed (its top-k read from the data:
# gptkit prepare data=chat ... teacher=<run>; distill_topk.py)
TEACHERS = ("live", "precomputed")


def precomputed_teacher(group: Any) -> bool:
    return group is not None and str(group.get("teacher", "live")) == "precomputed"


def check_distill_config(group: Any, prefix: str = "distill", beta_default: float = 0.0) -> None:
    """The distill block (or objective=gkd's, prefix gkd): one-line ConfigErrors for values that cannot
    train."""
    if group is None:
        return
    beta = number(group, "beta", beta_default, prefix)
    if not 0.0 <= beta <= 1.0:
        raise ConfigError(
            f"{prefix}.beta={beta:g} must be in [0, 1] (0: forward KL, 1: reverse KL, between: "
            "generalized JSD)"
        )
    teacher = group.get("teacher", "live")
    if teacher not in TEACHERS:
        raise ConfigError(f"{prefix}.teacher={teacher!r} is not one of {', '.join(TEACHERS)}")
    if teacher == "precomputed" and beta != 0.0:
        raise ConfigError(
            f"{prefix}.teacher=precomputed keeps the teacher's top-k, which defines the forward KL only "
            f"({prefix}.beta=0); {prefix}.beta={beta:g} reads the teacher's probability of every token"
        )
    temperature = number(group, "temperature", 1.0, prefix)
    if not temperature > 0:
        raise ConfigError(
            f"{prefix}.temperature={temperature:g} must be > 0 (1: the models' own distributions)"
        )
    alpha = number(group, "alpha", 0.5, prefix)
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(
            f"{prefix}.alpha={alpha:g} must be in [0, 1] (the weight of the label loss; 1 - alpha: the "
            "teacher's)"
        )


def divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """The divergence of each position (module docstring) from logits [..., V] -> [...], in fp32 (or the
    logits' dtype when wider); the gradient flows to the student's logits."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    s = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)  # [..., V] log s
    t = F.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)  # [..., V] log t
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    # log m = log(beta t + (1 - beta) s)
    m = torch.logsumexp(torch.stack([s + math.log1p(-beta), t + math.log(beta)]), dim=0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1.0 - beta) * (s.exp() * (s - m)).sum(-1)


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha * CE + (1 - alpha) * D, CE, D), each the mean over the label positions (targets [N, T] !=
    -100) of logits [N, T, V]; 0 (with a gradient path) where there are none. CE and D are detached."""
    mask = targets != -100  # [N, T]
    s, t = student_logits[mask], teacher_logits[mask]  # [M, V]: the label positions only
    n = mask.sum().clamp(min=1)
    d = divergence(s, t, beta, temperature).sum() / n
    ce = (
        F.cross_entropy(s.to(torch.promote_types(s.dtype, torch.float32)), targets[mask], reduction="sum") / n
    )
    return alpha * ce + (1.0 - alpha) * d, ce.detach(), d.detach()


def chunked_distill_loss(
    model: torch.nn.Module,
    teacher: FrozenModel,
    x: torch.Tensor,
    targets: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    alpha: float = 0.0,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """distill_loss's (loss, CE, D) of the student `model` against `teacher` on inputs x [N, T], computed from
    both models' final hidden states and heads chunk by chunk over the label positions
    (gptkit_kernels.linear_distill): neither pass holds either model's [N, T, vocab] fp32 logits. The teacher
    runs first (no grad); the loss runs inside the student's forward (GPT.forward(head=...))."""
    teacher_h, teacher_weight, teacher_softcap = teacher.head_inputs(model, x, doc_ids)  # [N, T, d_t]

    def head(h, weight, softcap):
        # the teacher's head is the policy's own (its adapters off): never trained, no gradient through it
        tw = weight.detach() if teacher_weight is None else teacher_weight
        return fused.linear_distill(
            h,
            weight,
            teacher_h,
            tw,
            targets,
            beta=beta,
            temperature=temperature,
            alpha=alpha,
            softcap=softcap,
            teacher_softcap=teacher_softcap,
        )

    return model(x, doc_ids=doc_ids, head=head).head


class Distill(LM):
    """objective=distill: the student (the model being trained) against frozen.teacher's distributions, mixed
    with the labels' cross-entropy; validated as objective=lm is."""

    name = "distill"
    group = "distill"
    # its loss reads both heads chunk by chunk (chunked_distill_loss): the memory estimate counts chunks
    chunked_logps = True

    @classmethod
    def check_config(cls, group: Any) -> None:
        check_distill_config(group)

    @classmethod
    def frozen_models(cls, group: Any) -> tuple[str, ...]:
        return () if precomputed_teacher(group) else ("teacher",)

    @classmethod
    def precomputed_models(cls, group: Any) -> tuple[str, ...]:
        return ("teacher",) if precomputed_teacher(group) else ()

    @classmethod
    def flops(cls, counts: Any, dense: float, causal: float, group: Any = None) -> tuple[float, float]:
        """The teacher's forward (no grad) added, counted at the student's size (as a reference's is); none
        with a precomputed teacher."""
        if precomputed_teacher(group):
            return dense, causal
        return dense + counts.forward_dense, causal + counts.forward_causal

    @classmethod
    def describe(cls, plan: Any) -> str | None:
        d = plan.cfg.get("distill") or {}
        beta = float(d.get("beta", 0.0))
        kind = {0.0: "forward KL", 1.0: "reverse KL"}.get(beta, f"generalized JSD beta {beta:g}")
        teacher = frozen_words(plan, "teacher", "the starting weights, frozen")
        if precomputed_teacher(d):
            teacher = (
                f"its top-k precomputed in the data, renormalized (no teacher held; its source: {teacher})"
            )
        return (
            f"distill: {kind}, temperature {float(d.get('temperature', 1.0)):g}, alpha "
            f"{float(d.get('alpha', 0.5)):g} (label loss weight); teacher: {teacher}"
        )

    def __init__(self, plan: Any, frozen: dict[str, FrozenModel] | None = None) -> None:
        super().__init__(plan, frozen)
        cfg = self.settings or {}
        self.beta = float(cfg.get("beta", 0.0))
        self.temperature = float(cfg.get("temperature", 1.0))
        self.alpha = float(cfg.get("alpha", 0.5))
        # the teacher's top-k ids and log-probs come last in every training batch (gptkit.data.chat)
        self.precomputed = precomputed_teacher(cfg)
        self.teacher = self.frozen.get("teacher")
        # [3] sums since the last log step: CE x tokens, D x tokens, tokens
        self._train: torch.Tensor | None = None

    def loss(self, model, batch):
        # [B, T] inputs, [B, T] next-token targets (, [B, T] doc_ids: data.pack=documents)
        x, y, *docs = batch
        if self.precomputed:
            # [B, T, k] each: the teacher's top-k ids and log-probs at the label positions
            *docs, ids, logps = docs
        doc_ids = docs[0] if docs else None
        if self.precomputed:
            loss, ce, d = chunked_topk_distill_loss(
                model, x, ids, logps, y, self.temperature, self.alpha, doc_ids
            )
        else:
            loss, ce, d = chunked_distill_loss(
                model, self.teacher, x, y, self.beta, self.temperature, self.alpha, doc_ids
            )
        n = loss_tokens(y)
        row = torch.stack([ce * n, d * n, n.to(ce.dtype)])
        self._train = row if self._train is None else self._train + row
        return loss, n

    def train_metrics(self, strategy) -> dict[str, float]:
        if self._train is None:
            return {}
        sums = self._train if strategy is None else strategy.reduce(self._train, reduce_op="sum")
        self._train = None
        n = float(sums[2])
        if not n:
            return {}
        return {"train/distill/ce": float(sums[0]) / n, "train/distill/divergence": float(sums[1]) / n}

    def progress(self, metrics: dict[str, float]) -> list[str]:
        if "train/distill/divergence" not in metrics:
            return []
        return [f"ce {metrics['train/distill/ce']:.4f} div {metrics['train/distill/divergence']:.4f}"]
