"""Distillation loss from two models' hidden states and heads, without the [tokens, vocab] logits of either
(pure torch; no triton needed). The chunked twin of gptkit/training/objectives/distill.py's `distill_loss`.

    linear_distill(x, weight, teacher_x, teacher_weight, targets, *, beta, temperature=1.0, alpha=0.0,
                   ignore_index=-100, chunk_size=None, softcap=None, teacher_softcap=None) -> (loss, ce, d)
    x: [..., d] the student's final hidden states, weight: [V, d] its head (possibly tied to the embedding);
    teacher_x: [..., d_t], teacher_weight: [V, d_t] the teacher's (no gradient reaches them);
    targets: [...] int, ignore_index marks positions without a label.
    At each label position, with s and t the student's and the teacher's softmax(logits / temperature)
    (logits = x @ weight^T, soft-capped to softcap * tanh(logits / softcap) when a cap is given):
        beta = 0   D = KL(t || s);   beta = 1   D = KL(s || t);
        between    D = beta KL(t || m) + (1 - beta) KL(s || m),  m = beta t + (1 - beta) s
    and CE the student's cross-entropy at temperature 1. Returns fp32 scalars: alpha * CE + (1 - alpha) * D,
    CE and D, each the mean over the label positions (0 where there are none); only the loss has a gradient.

Only the label positions are computed: their rows are picked out first (one host sync, as boolean indexing
is, unless the caller gives them: label_rows), then processed in chunks of `chunk_size` rows (default:
linear_ce's chunk_rows budget split over the CHUNK_TENSORS chunk-sized tensors one chunk holds). For each
chunk the forward pass computes both models' fp32 logits, their log-sum-exps (kept: three fp32 values per
label position), CE and D, and drops the logits. The backward pass (the gradient coming back is one number,
so this is linear_log_probs' scheme: recompute rather than keep) recomputes each chunk's logits from the
saved hidden states, heads and log-sum-exps (one more matmul per head) and turns them into d loss / d logits:

    alpha (softmax(z) - onehot(target)) + (1 - alpha) / temperature * g,   z the capped student logits
    g = s - t                                      beta = 0
    g = s * (q - sum_v s_v q_v),  q = log s - log t                   beta = 1
                                  q = (1 - beta) (log s - log m)      0 < beta < 1

then through the cap and the head into dx and dweight (linear_ce's through_cap and head_back). One chunk of
each model's fp32 logits exists at a time, in both passes.

    linear_topk_distill(x, weight, teacher_ids, teacher_logps, targets, *, temperature=1.0, alpha=0.0, ...)
    the same loss against a precomputed teacher's top-k (distill.teacher=precomputed): the same loop (beta
    None in its settings), the teacher's side log t~ [M, k] renormalized once and gathered at its k ids in
    place of a head: D_k = sum_k t~ (log t~ - log s), g = s - t~ (t~ 0 outside the top-k).
"""

from __future__ import annotations

import math

import torch

from gptkit_kernels.linear_ce import _scaled_logits, chunk_rows, head_back, matmul_operands, through_cap

# chunk-sized fp32 tensors one chunk holds at once (student and teacher log-probs, the cap, the mixture,
# products): the rows per chunk are chunk_rows' divided by this, so a chunk stays near linear_ce's budget
CHUNK_TENSORS = 4


def _log_probs(x, weight, acc, softcap, temperature, lse=None):
    """(log softmax(logits / temperature) [C, V] fp32, its log-sum-exp [C], the cap's tanh or None) of one
    chunk; `lse` given: the saved one (the backward)."""
    z, capped = _scaled_logits(x, weight, acc, softcap, temperature)  # [C, V]
    if lse is None:
        lse = torch.logsumexp(z, dim=-1)  # [C]
    return z.sub_(lse[:, None]), lse, capped


def _mixture(ls, lt, beta: float):
    """log m = log(beta t + (1 - beta) s) [C, V], from log s and log t."""
    return torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))


def _divergence(ls, lt, beta: float):
    """D of each row [C] from log s and log t [C, V] (the module docstring's formulas)."""
    if beta == 0.0:
        return (lt.exp() * (lt - ls)).sum(-1)
    if beta == 1.0:
        return (ls.exp() * (ls - lt)).sum(-1)
    lm = _mixture(ls, lt, beta)  # [C, V]
    return beta * (lt.exp() * (lt - lm)).sum(-1) + (1.0 - beta) * (ls.exp() * (ls - lm)).sum(-1)


def _divergence_grad(ls, lt, beta: float):
    """d D / d (student logits / temperature) [C, V] of each row (the module docstring's g)."""
    s = ls.exp()  # [C, V]
    if beta == 0.0:
        return s.sub_(lt.exp())
    q = ls - lt if beta == 1.0 else (ls - _mixture(ls, lt, beta)).mul_(1.0 - beta)  # [C, V]
    return q.sub_((s * q).sum(-1, keepdim=True)).mul_(s)


def _forward(x, weight, tx, tweight, targets, rows: int, args):
    """(CE [M], D [M], the log-sum-exps [3, M]: student at temperature 1, student and teacher at
    `temperature`) of the M label rows, chunk by chunk."""
    beta, temperature, softcap, teacher_softcap = args
    M = x.shape[0]
    acc = torch.promote_types(x.dtype, torch.float32)
    ce = torch.empty(M, device=x.device, dtype=acc)  # [M]
    div = torch.empty(M, device=x.device, dtype=acc)  # [M]
    lse = torch.empty(3, M, device=x.device, dtype=acc)  # [3, M]
    for s in range(0, M, rows):
        xc, tc = x[s : s + rows], targets[s : s + rows]  # [C, d], [C]
        # the capped student logits: the labels' CE at temperature 1, then log s at `temperature` in place
        z, capped = _scaled_logits(xc, weight, acc, softcap, 1.0)  # [C, V]
        del capped
        lse1 = torch.logsumexp(z, dim=-1)  # [C]
        ce[s : s + rows] = lse1 - z.gather(1, tc[:, None])[:, 0]
        lse[0, s : s + rows] = lse1
        lse_s = lse1
        if temperature != 1.0:
            lse_s = torch.logsumexp(z.div_(temperature), dim=-1)  # [C]
        ls = z.sub_(lse_s[:, None])  # [C, V]
        lse[1, s : s + rows] = lse_s
        if beta is None:
            # the teacher's top-k: ids tx [M, k], log t~ tweight [M, k] (no teacher head)
            lt = tweight[s : s + rows]  # [C, k]
            div[s : s + rows] = (lt.exp() * (lt - ls.gather(1, tx[s : s + rows]))).sum(-1)
        else:
            lt, lse[2, s : s + rows], _ = _log_probs(
                tx[s : s + rows], tweight, acc, teacher_softcap, temperature
            )
            div[s : s + rows] = _divergence(ls, lt, beta)
        del z, ls, lt
    return ce, div, lse


class LinearDistill(torch.autograd.Function):
    """alpha * CE + (1 - alpha) * D over the label rows x [M, d] (the module docstring); the backward
    recomputes each chunk's logits from the saved inputs and log-sum-exps."""

    @staticmethod
    def forward(ctx, x, weight, tx, tweight, targets, alpha: float, rows: int, args):
        ce, div, lse = _forward(x, weight, tx, tweight, targets, rows, args)
        n = max(x.shape[0], 1)
        ce_mean, d_mean = ce.sum() / n, div.sum() / n
        ctx.save_for_backward(x, weight, tx, tweight, targets, lse)
        ctx.args = (alpha, rows, args)
        ctx.mark_non_differentiable(ce_mean, d_mean)
        return alpha * ce_mean + (1.0 - alpha) * d_mean, ce_mean, d_mean

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_ce, _grad_d):
        x, weight, tx, tweight, targets, lse = ctx.saved_tensors
        alpha, rows, (beta, temperature, softcap, teacher_softcap) = ctx.args
        grad_x, grad_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse.dtype
        M = x.shape[0]
        # d loss / d (CE_i, D_i) of each row: the mean's 1 / M times the weights, times what comes in
        g = grad_loss.to(acc) / max(M, 1)
        g_ce, g_d = g * alpha, g * ((1.0 - alpha) / temperature)
        dx = torch.empty_like(x) if grad_x else None  # [M, d]
        dw = torch.zeros(weight.shape, device=weight.device, dtype=acc) if grad_w else None  # [V, d]
        with torch.autocast(x.device.type, enabled=False):
            for s in range(0, M, rows):
                xc, tc = x[s : s + rows], targets[s : s + rows]  # [C, d], [C]
                lse1, lse_s, lse_t = lse[0, s : s + rows], lse[1, s : s + rows], lse[2, s : s + rows]
                # z: the capped student logits; log s at `temperature` from them
                z, capped = _scaled_logits(xc, weight, acc, softcap, 1.0)  # [C, V]
                ls = (z / temperature).sub_(lse_s[:, None])  # [C, V]
                if beta is None:
                    # d D_k / d (student logits / temperature) = s - t~ (t~ 0 outside the top-k)
                    gd = ls.exp_().scatter_add_(1, tx[s : s + rows], tweight[s : s + rows].exp().neg_())
                    gd.mul_(g_d)  # [C, V]
                    lt = None
                else:
                    lt, _, _ = _log_probs(tx[s : s + rows], tweight, acc, teacher_softcap, temperature, lse_t)
                    gd = _divergence_grad(ls, lt, beta).mul_(g_d)  # [C, V]
                del ls, lt
                # z becomes alpha (softmax - onehot) g + gd, in place
                z.sub_(lse1[:, None]).exp_()
                z.scatter_add_(1, tc[:, None], torch.full_like(z[:, :1], -1.0))
                z.mul_(g_ce).add_(gd)
                del gd
                gz = through_cap(z, capped, x.dtype)  # [C, V]
                del z, capped
                head_back(gz, xc, weight, None if dx is None else dx[s : s + rows], dw)
                del gz
        dw = None if dw is None else dw.to(weight.dtype)
        return dx, dw, None, None, None, None, None, None


def linear_distill(
    x: torch.Tensor,
    weight: torch.Tensor,
    teacher_x: torch.Tensor,
    teacher_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    alpha: float = 0.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    label_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha * CE + (1 - alpha) * D, CE, D): the module docstring's means over targets != ignore_index,
    chunked over those positions so that neither model's [tokens, vocab] logits exist whole. Differentiable in
    x and weight (CE and D are detached figures); the teacher's inputs get no gradient. label_rows: the
    label positions' indices into the flattened [N] positions when the caller knows them (no host sync; fake
    tensors), in place of targets != ignore_index."""
    d, dt = x.shape[-1], teacher_x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight must be [vocab, {d}], got {tuple(weight.shape)}")
    if teacher_weight.shape != (weight.shape[0], dt):
        raise ValueError(
            f"teacher_weight must be [{weight.shape[0]}, {dt}], got {tuple(teacher_weight.shape)}"
        )
    if targets.shape != x.shape[:-1] or teacher_x.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} and teacher_x {tuple(teacher_x.shape)} must match x's leading "
            f"dims {tuple(x.shape[:-1])}"
        )
    if not 0.0 <= beta <= 1.0 or not temperature > 0:
        raise ValueError(f"beta must be in [0, 1] and temperature > 0, got {beta}, {temperature}")
    if label_rows is None:
        label_rows = (targets.reshape(-1) != ignore_index).nonzero()[:, 0]  # [M]
    # the label rows only: [M, d], [M, d_t], [M]
    x2, tx2 = (
        x.reshape(-1, d).index_select(0, label_rows),
        teacher_x.reshape(-1, dt).index_select(0, label_rows),
    )
    t2 = targets.reshape(-1).index_select(0, label_rows)
    device = x.device.type
    # the matmuls in the autocast dtype, as F.linear would run them
    x2, w2 = matmul_operands(x2, weight)
    tx2, tw2 = matmul_operands(tx2, teacher_weight)
    tx2, tw2 = tx2.detach(), tw2.detach()
    rows = chunk_rows(x2.shape[0], weight.shape[0], chunk_size)
    if chunk_size is None:
        rows = max(1, rows // CHUNK_TENSORS)
    args = (float(beta), float(temperature), softcap, teacher_softcap)
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (x2.requires_grad or w2.requires_grad):
            return LinearDistill.apply(x2, w2, tx2, tw2, t2, float(alpha), rows, args)
        ce, div, _ = _forward(x2, w2, tx2, tw2, t2, rows, args)
        n = max(x2.shape[0], 1)
        ce, div = ce.sum() / n, div.sum() / n
        return alpha * ce + (1.0 - alpha) * div, ce, div


def linear_topk_distill(
    x: torch.Tensor,
    weight: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logps: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    alpha: float = 0.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear_distill against a precomputed teacher's top-k (gptkit/training/objectives/distill_topk.py's
    topk_distill_loss, chunked): (alpha * CE + (1 - alpha) * D_k, CE, D_k), the means over targets !=
    ignore_index, D_k = sum over the top-k of t~ (log t~ - log s), t~ = softmax(teacher_logps / temperature)
    over the k kept tokens. teacher_ids [..., k] (int) and teacher_logps [..., k] match targets' dims [...]
    (read at the label positions only); the same chunks and recomputing backward as linear_distill (its
    loop, the teacher's side a gather of the k ids in place of a head): only the student's logits exist, one
    chunk at a time. Differentiable in x and weight."""
    d = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight must be [vocab, {d}], got {tuple(weight.shape)}")
    if (
        targets.shape != x.shape[:-1]
        or teacher_ids.shape[:-1] != x.shape[:-1]
        or teacher_logps.shape != teacher_ids.shape
    ):
        raise ValueError(
            f"targets {tuple(targets.shape)}, teacher_ids {tuple(teacher_ids.shape)} and teacher_logps "
            f"{tuple(teacher_logps.shape)} must match x's leading dims {tuple(x.shape[:-1])}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    k = teacher_ids.shape[-1]
    label_rows = (targets.reshape(-1) != ignore_index).nonzero()[:, 0]  # [M]
    x2 = x.reshape(-1, d).index_select(0, label_rows)  # [M, d]
    t2 = targets.reshape(-1).index_select(0, label_rows)  # [M]
    ids = teacher_ids.reshape(-1, k).index_select(0, label_rows).long()  # [M, k]
    acc = torch.promote_types(x.dtype, torch.float32)
    # log t~ [M, k]: the kept log-probs renormalized at the temperature
    lt = torch.log_softmax(teacher_logps.reshape(-1, k).index_select(0, label_rows).to(acc) / temperature, -1)
    device = x.device.type
    x2, w2 = matmul_operands(x2, weight)
    lt = lt.detach()
    rows = chunk_rows(x2.shape[0], weight.shape[0], chunk_size)
    if chunk_size is None:
        rows = max(1, rows // CHUNK_TENSORS)
    # beta None: the top-k teacher (_forward's and the backward's other branch)
    args = (None, float(temperature), softcap, None)
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (x2.requires_grad or w2.requires_grad):
            return LinearDistill.apply(x2, w2, ids, lt, t2, float(alpha), rows, args)
        ce, div, _ = _forward(x2, w2, ids, lt, t2, rows, args)
        n = max(x2.shape[0], 1)
        ce, div = ce.sum() / n, div.sum() / n
        return alpha * ce + (1.0 - alpha) * div, ce, div
