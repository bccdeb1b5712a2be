"""On-policy distillation (GKD, Agarwal et al. 2024, arXiv:2306.13649): objective=gkd (docs/distillation.md).

The student (the model being trained) continues the start of its own training rows, and frozen.teacher scores
every token it sampled. Each micro-step m of a run (counted from the run's first, kept in every checkpoint) is
on-policy when u_m < gkd.lmbda, u_m = sample_key(seed, m, -1, 0) / 2^64 (TRL 1.16 GKDTrainer's lmbda, the
share of steps trained on the student's own samples, drawn per step from a keyed number so that a resume
draws the same). An on-policy micro-step, for row b (of B) of the batch on rank r:

  1. prompt      p_b = the first gkd.prompt_len tokens of the row
  2. completion  c_b = K tokens sampled from the student at gkd.temperature through GRPO's sampler
                 (gptkit.inference.rollouts.sample_rows: the KV cache, eval mode, no grad), with the key
                 sample_key(seed, m, r B + b, 0) (r B + b: the row's place in the micro-step's global batch,
                 of which every sampler gives rank r the slice [r B, (r + 1) B): 2 ranks draw what one
                 process of 2 B rows draws), K = min(gkd.max_new_tokens, trainer.seq_len - prompt_len);
                 no stop token (the rows are a stream of text), so every completion has K tokens
  3. divergence  at each completion position t (the K positions that predict c_b's tokens, on the row
                 p_b c_b),
                 s and t the student's and the teacher's next-token distributions at gkd.temperature:
                 D_t = distill.py's divergence: gkd.beta 1 the reverse KL sum_v s_v (log s_v - log t_v) (the
                 default: the per-token reverse KL of on-policy distillation), 0 the forward KL, between the
                 generalized JSD; the gradient flows through s at every position (not through the sampling),
                 as TRL's GKDTrainer
  4. loss        alpha * CE(student, the row's labels) + (1 - alpha) * mean_t D_t

where CE is the student's cross-entropy on the corpus row itself (its labels; 0 < alpha: a second student
forward). An off-policy micro-step is objective=distill's step with gkd's settings: D on the row's own label
positions. A micro-batch weighs its label count, as objective=lm's. Validation is objective=lm's: val/loss is
the student's cross-entropy on the labels. The train rows add train/distill/ce, train/distill/divergence and
train/distill/on_policy (the share of on-policy micro-steps since the last log step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gptkit.errors import ConfigError
from gptkit.inference.rollouts import RolloutOptions, sample_key, sample_rows
from gptkit.training.objectives.base import FrozenModel, frozen_words
from gptkit.training.objectives.distill import Distill, check_distill_config, chunked_distill_loss, number
from gptkit.training.objectives.grpo_rows import completion_rows
from gptkit.training.token_mean import loss_tokens

_TWO_64 = float(2**64)


def _count(group: Any, key: str, default: Any, nullable: bool = False) -> int | None:
    value = group.get(key, default)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        tail = " or null (the rest of the row)" if nullable else ""
        raise ConfigError(f"gkd.{key}={value!r} must be a positive integer{tail}")
    return int(value)


def check_gkd_config(group: Any) -> None:
    """The gkd block: one-line ConfigErrors for values that cannot train."""
    if group is None:
        return
    check_distill_config(group, "gkd", beta_default=1.0)
    lmbda = number(group, "lmbda", 1.0, "gkd")
    if not 0.0 <= lmbda <= 1.0:
        raise ConfigError(
            f"gkd.lmbda={lmbda:g} must be in [0, 1] (the share of steps on the student's own samples)"
        )
    _count(group, "prompt_len", 16)
    _count(group, "max_new_tokens", None, nullable=True)


def on_policy(seed: int, micro_step: int, lmbda: float) -> bool:
    """Whether micro-step micro_step trains on the student's samples: a keyed uniform below lmbda."""
    return sample_key(seed, micro_step, -1, 0) / _TWO_64 < lmbda


class GKD(Distill):
    """objective=gkd: the student's own continuations of its rows' starts, scored token by token by
    frozen.teacher (module docstring); validated as objective=lm is."""

    name = "gkd"
    group = "gkd"

    @classmethod
    def check_config(cls, group: Any) -> None:
        check_gkd_config(group)

    @classmethod
    def check_run(cls, cfg: Any) -> None:
        if (cfg.get("trainer") or {}).get("compile") not in (None, False, "none", "false"):
            raise ConfigError(
                "objective=gkd samples through a growing KV cache, for which a compiled block would compile "
                "again and again; use trainer.compile=none"
            )
        data = cfg.get("data") or {}
        if data.get("pack") == "documents":
            raise ConfigError(
                "objective=gkd continues the start of each row as one text; data.pack=documents (attention "
                "inside each document) is not supported: use data.pack=stream"
            )
        g = cfg.get("gkd") or {}
        seq_len = (cfg.get("trainer") or {}).get("seq_len") or (cfg.get("model") or {}).get("max_seq_len")
        prompt_len = int(g.get("prompt_len", 16))
        if seq_len is not None and prompt_len >= int(seq_len):
            raise ConfigError(
                f"gkd.prompt_len={prompt_len} leaves no room to sample in rows of {int(seq_len)} tokens "
                "(trainer.seq_len): it must be shorter"
            )

    @classmethod
    def flops(cls, counts: Any, dense: float, causal: float, group: Any = None) -> tuple[float, float]:
        """The teacher's forward (counted at the student's size), and on the on-policy share lmbda of steps
        the sampling (a forward per token) and, with alpha > 0, the labels' pass (a training pass more)."""
        g = group if group is not None else {}
        lmbda, alpha = float(g.get("lmbda", 1.0)), float(g.get("alpha", 0.5))
        extra = lmbda * (alpha > 0)
        return (
            dense * (1 + extra) + (1 + lmbda) * counts.forward_dense,
            causal * (1 + extra) + (1 + lmbda) * counts.forward_causal,
        )

    @classmethod
    def describe(cls, plan: Any) -> str | None:
        g = plan.cfg.get("gkd") or {}
        beta, prompt = float(g.get("beta", 1.0)), int(g.get("prompt_len", 16))
        kind = {0.0: "forward KL", 1.0: "reverse KL"}.get(beta, f"generalized JSD beta {beta:g}")
        room = plan.seq_len - prompt
        k = min(int(g["max_new_tokens"]), room) if g.get("max_new_tokens") else room
        lmbda, tau, alpha = (
            float(g.get(key, d)) for key, d in (("lmbda", 1), ("temperature", 1), ("alpha", 0.5))
        )
        teacher = frozen_words(plan, "teacher", "the starting weights, frozen")
        return (
            f"gkd: on-policy share (lmbda) {lmbda:g}: {k} tokens sampled after the first {prompt} of each "
            f"row, {kind} per token, temperature {tau:g}, alpha {alpha:g} (label loss weight); teacher: "
            f"{teacher}"
        )

    def __init__(self, plan: Any, frozen: dict[str, FrozenModel] | None = None) -> None:
        super().__init__(plan, frozen)
        cfg = self.settings or {}
        self.beta = float(cfg.get("beta", 1.0))
        self.lmbda = float(cfg.get("lmbda", 1.0))
        self.prompt_len = int(cfg.get("prompt_len", 16))
        seq_len = int(plan.seq_len)
        if self.prompt_len >= seq_len:
            raise ConfigError(
                f"gkd.prompt_len={self.prompt_len} leaves no room to sample in rows of {seq_len} tokens "
                "(trainer.seq_len): it must be shorter"
            )
        new = cfg.get("max_new_tokens")
        self.new_tokens = min(int(new), seq_len - self.prompt_len) if new else seq_len - self.prompt_len
        self.seed = int(plan.cfg.seed)
        self.pad_id = 0
        # the run's micro-steps so far (a checkpoint keeps it: a resume draws the same samples)
        self.micro = 0
        # [4] sums since the last log step: CE x tokens, D x tokens, tokens, on-policy micro-steps; steps
        self._train = None
        self._steps = 0

    def sample(self, model, x: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(xs, ys) [B, P + K - 1]: each row's first prompt_len tokens followed by the student's completion
        (keys (seed, step, rank x B + b, 0)); ys the completion's tokens at the positions that predict them,
        else -100."""
        b = x.shape[0]
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        prompts = x[:, : self.prompt_len].tolist()
        keys = [sample_key(self.seed, step, rank * b + i, 0) for i in range(b)]
        opts = RolloutOptions(self.new_tokens, self.temperature)
        done = sample_rows(model, prompts, keys, opts, self.new_tokens)
        xs, ys = completion_rows(prompts, [c.tokens for c in done], self.pad_id)
        return xs.to(x.device), ys.to(x.device)

    def loss(self, model, batch):
        # [B, T] inputs, [B, T] next-token targets
        x, y, *docs = batch
        step, self.micro = self.micro, self.micro + 1
        n = loss_tokens(y)
        if not on_policy(self.seed, step, self.lmbda):
            loss, ce, d = self._offline(model, x, y, docs[0] if docs else None)
            self._add(ce, d, n, 0.0)
            return loss, n
        xs, ys = self.sample(model, x, step)
        # the mean divergence over the completion positions (alpha 0: D alone, with its gradient), chunked
        # over them as objective=distill's (no [B, P + K - 1, V] logits of either model)
        d, _, d_value = chunked_distill_loss(model, self.teacher, xs, ys, self.beta, self.temperature, 0.0)
        if self.alpha > 0:
            ce = model(x, y).loss
            loss = self.alpha * ce + (1.0 - self.alpha) * d
        else:
            ce, loss = torch.zeros((), device=x.device), d
        self._add(ce.detach(), d_value, n, 1.0)
        return loss, n

    def _offline(self, model, x, y, doc_ids):
        return chunked_distill_loss(
            model, self.teacher, x, y, self.beta, self.temperature, self.alpha, doc_ids
        )

    def _add(self, ce, d, n, on: float) -> None:
        row = torch.stack([ce.float() * n, d.float() * n, n.float(), n.new_tensor(on, dtype=torch.float32)])
        self._train = row if self._train is None else self._train + row
        self._steps += 1

    def train_metrics(self, strategy) -> dict[str, float]:
        if self._train is None:
            return {}
        sums = self._train if strategy is None else strategy.reduce(self._train, reduce_op="sum")
        world = strategy.world_size if strategy is not None else 1
        steps = self._steps * world
        self._train, self._steps = None, 0
        n = float(sums[2])
        if not n:
            return {}
        return {
            "train/distill/ce": float(sums[0]) / n,
            "train/distill/divergence": float(sums[1]) / n,
            "train/distill/on_policy": float(sums[3]) / steps,
        }

    def state(self) -> dict[str, Any] | None:
        return {"micro": int(self.micro)}

    def load_state(self, state: dict[str, Any] | None) -> None:
        if state:
            self.micro = int(state["micro"])
