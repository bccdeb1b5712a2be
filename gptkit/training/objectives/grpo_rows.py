"""GRPO's rows and figures: one micro-batch's completions as training rows (Rollouts, completion_rows, the
sampler's log-probs in place: sampled_rows) and the running sums of its train metrics (Figures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Rollouts:
    """One micro-batch's completions as training rows, what its loss reads.

    x           [N, T] int64: prompt and completion (N = prompts x group_size), right-padded
    y           [N, T] int64: the next token where it is a completion's, else -100
    advantages  [N] fp32
    old         [N, T] fp32: log-probs of the policy that sampled them (None: the first pass's, detached)
    ref         [N, T] fp32: the reference's log-probs (None: no reference)
    sampled     [N, T] fp32: the sampler's own log-prob of each completion token (0 elsewhere; None: rollouts
                kept by a run from before it was recorded)"""

    x: torch.Tensor
    y: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    sampled: torch.Tensor | None = None

    FIELDS = ("x", "y", "advantages", "old", "ref", "sampled")

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k).detach().cpu() for k in self.FIELDS if getattr(self, k) is not None}

    @classmethod
    def from_dict(cls, d: dict[str, torch.Tensor], device) -> "Rollouts":
        return cls(**{k: d[k].to(device) if k in d else None for k in cls.FIELDS})

    def rows(self, a: int, b: int) -> "Rollouts":
        """Rows [a, b)."""
        return Rollouts(*(None if t is None else t[a:b] for t in (getattr(self, k) for k in self.FIELDS)))


def pad_rows(seqs: list[list[int]], pad: int) -> torch.Tensor:
    """[N, max len] int64, each sequence then pad."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.long)  # [N, T]
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def completion_rows(prompts: list[list[int]], completions: list[list[int]], pad: int):
    """(x, y) [N, T] of each prompt (repeated for its completions, in order) followed by its completion:
    x = the row without its last token, y = the next token where it is a completion's, else -100."""
    g = len(completions) // len(prompts)
    full = [prompts[i // g] + c for i, c in enumerate(completions)]
    ids = pad_rows(full, pad)  # [N, T + 1]
    x = ids[:, :-1]  # [N, T]
    y = torch.full_like(x, -100)  # [N, T]
    for i, c in enumerate(completions):
        p = len(prompts[i // g])
        y[i, p - 1 : p - 1 + len(c)] = torch.tensor(c, dtype=torch.long)
    return x.contiguous(), y


def sampled_rows(prompts: list[list[int]], groups, shape) -> torch.Tensor:
    """[N, T] fp32 (shape: completion_rows' y): each completion token's log-prob as its sampler computed it,
    where y holds the token, else 0."""
    out = torch.zeros(shape, dtype=torch.float32)
    for i, c in enumerate(c for group in groups for c in group):
        p = len(prompts[i // len(groups[0])])
        out[i, p - 1 : p - 1 + len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return out


class Figures:
    """Sums of a window of rollouts and losses (train: between two log steps; val: one validation), read over
    every rank: the generation side's in Python floats, the loss side's on the device (no host sync)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.reset()

    def reset(self) -> None:
        k = len(self.names)
        # completions; per reward sum and sum of squares; total sum, sum of squares; groups, groups with zero
        # std; completion tokens, completions cut at the length limit; generation seconds
        self.host = [0.0] * (1 + 2 * k + 2 + 2 + 2 + 1)
        self.longest = 0.0
        self.device: dict[str, torch.Tensor] = {}
        # figures read as their maximum over the window and the ranks (rollout_logprob_diff)
        self.maxima: dict[str, torch.Tensor] = {}

    def add_rollouts(self, scores: list[list[list[float]]], totals: list[list[float]], lengths, cut, seconds):
        """One micro-batch's rewards (scores[p][i][k]: reward k of completion i of prompt p; totals[p][i]),
        completion lengths (flat), completions cut and generation seconds."""
        h, k = self.host, len(self.names)
        for group_scores, group_totals in zip(scores, totals):
            for s, t in zip(group_scores, group_totals):
                h[0] += 1
                for j, v in enumerate(s):
                    h[1 + 2 * j] += v
                    h[2 + 2 * j] += v * v
                h[1 + 2 * k] += t
                h[2 + 2 * k] += t * t
            h[3 + 2 * k] += 1
            h[4 + 2 * k] += float(max(group_totals) == min(group_totals))
        h[5 + 2 * k] += float(sum(lengths))
        h[6 + 2 * k] += float(cut)
        h[7 + 2 * k] += float(seconds)
        self.longest = max(self.longest, float(max(lengths, default=0)))

    def add_loss(self, figures: dict[str, torch.Tensor]) -> None:
        for key, v in figures.items():
            v = v.detach().float()
            self.device[key] = v if key not in self.device else self.device[key] + v

    def add_max(self, key: str, value: torch.Tensor) -> None:
        v = value.detach().float()
        self.maxima[key] = v if key not in self.maxima else torch.maximum(self.maxima[key], v)

    def read(self, strategy, device) -> dict[str, float] | None:
        """The window's sums (and maxima) over every rank (None when nothing was added), then start afresh."""
        keys, top = sorted(self.device), sorted(self.maxima)
        if not self.host[0] and not keys:
            return None
        host = torch.tensor(self.host, dtype=torch.float64, device=device)
        dev = [self.device[k].to(device, torch.float64).reshape(1) for k in keys]
        sums = torch.cat([host, *dev])
        # the longest completion first, then the maxima
        most = [torch.tensor([self.longest], dtype=torch.float64, device=device)]
        most += [self.maxima[k].to(device, torch.float64).reshape(1) for k in top]
        most = torch.cat(most)
        if strategy is not None:
            sums = strategy.reduce(sums, reduce_op="sum")
            most = strategy.reduce(most, reduce_op="max")
        values, highest = sums.tolist(), most.tolist()
        self.reset()
        out = {"host": values[: len(self.host)], "longest": highest[0]}
        out.update(zip(keys, values[len(self.host) :]))
        out.update(zip(top, highest[1:]))
        return out


def mean_std(total: float, squares: float, n: float) -> tuple[float, float]:
    """Mean and (population) std from a sum and a sum of squares of n values."""
    mean = total / n
    return mean, math.sqrt(max(0.0, squares / n - mean * mean))
