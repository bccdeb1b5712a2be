"""Linear layer + cross-entropy, and linear layer + per-token log-probs, without the [tokens, vocab] logits
(pure torch; no triton needed).

    linear_cross_entropy(x, weight, targets, ignore_index=-100, chunk_size=None, softcap=None) -> loss
    x: [N, d] hidden states, weight: [V, d] (the lm_head, possibly tied to the embedding),
    targets: [N] int, ignore_index marks positions without a target.
    loss: fp32 scalar = mean over the non-ignored targets of logsumexp(logits) - logits[target],
          logits = x @ weight^T (as F.cross_entropy(F.linear(x, weight).float(), targets) computes it),
          soft-capped to softcap * tanh(logits / softcap) when softcap is given (Gemma 2's final logits)

The tokens are processed in chunks of `chunk_size` rows (default: about 2^26 logits per chunk,
e.g. 523 tokens at a 128k vocabulary): for each chunk the forward pass computes its logits in
fp32, their log-sum-exp and loss, and at once the gradient of the mean loss with respect to those
logits, (softmax - onehot) / n_valid, which it turns into the chunk's dx rows and adds to dweight
(fp32). Only one chunk of logits exists at a time, in the forward and in the backward pass; the
backward pass only scales the saved dx and dweight by the incoming gradient. Without gradients
(evaluation) only the loss is computed. Under autocast the matmuls run in the autocast dtype, as
an nn.Linear would.

    linear_log_probs(x, weight, targets, ignore_index=-100, chunk_size=None, softcap=None, temperature=1.0)
    -> log-probs [N] (fp32) of each target under the (soft-capped) logits divided by temperature, 0 where
       ignored: what DPO, KTO and GRPO read (summed per answer, or per token). Same chunks; since the
       gradient coming back is one number per token, known only in the backward pass, the backward
       recomputes each chunk's logits from the saved x, weight and log-sum-exp [N] (one more head matmul)
       rather than keeping any: one chunk of fp32 logits exists at a time in both passes.
"""

from __future__ import annotations

import torch

# logits per chunk (256 MB in fp32) when no chunk_size is given
CHUNK_LOGITS = 1 << 26


def matmul_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, weight) in the dtype the head's matmul runs in: autocast's where it is on (as F.linear would run
    them), else x's."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return x.to(dtype), weight.to(dtype)
    return x, weight.to(x.dtype)


def chunk_rows(n_tokens: int, vocab_size: int, chunk_size: int | None = None) -> int:
    """Rows per chunk: chunk_size, or as many as keep a chunk of fp32 logits near CHUNK_LOGITS."""
    if chunk_size is not None:
        return max(1, int(chunk_size))
    # ceil
    n_chunks = -(-n_tokens * vocab_size // CHUNK_LOGITS)
    return max(1, -(-n_tokens // max(n_chunks, 1)))


def _chunked(x, weight, targets, ignore_index: int, rows: int, grad_x: bool, grad_w: bool, softcap=None):
    """(mean loss, dx, dweight): the gradients of the mean loss (None where not wanted), chunk by chunk."""
    N = x.shape[0]
    # logits, loss and dweight: fp32 (fp64 stays fp64)
    acc = torch.promote_types(x.dtype, torch.float32)
    valid_all = targets != ignore_index  # [N]
    n_valid = valid_all.sum()
    # d mean / d loss_i (a tensor: no host sync)
    scale = 1.0 / n_valid.clamp_min(1).to(acc)
    dx = torch.empty_like(x) if grad_x else None  # [N, d]
    dw = torch.zeros(weight.shape, device=weight.device, dtype=acc) if grad_w else None  # [V, d]
    total = torch.zeros((), device=x.device, dtype=acc)
    for s in range(0, N, rows):
        xc = x[s : s + rows]  # [C, d]
        valid = valid_all[s : s + rows]  # [C]
        tc = torch.where(valid, targets[s : s + rows], 0)  # [C], an index in range for ignored rows
        logits = (xc @ weight.t()).to(acc)  # [C, V] fp32: the one chunk of logits alive
        capped = None
        if softcap is not None:
            capped = torch.tanh(logits / softcap)  # [C, V]
            logits = capped * softcap
        lse = torch.logsumexp(logits, dim=-1)  # [C]
        picked = logits.gather(1, tc[:, None])[:, 0]  # [C]
        total += torch.where(valid, lse - picked, 0.0).sum()
        # logits become d mean_loss / d logits, in place
        if grad_x or grad_w:
            # softmax
            logits.sub_(lse[:, None]).exp_()
            logits.scatter_add_(1, tc[:, None], torch.full_like(picked[:, None], -1.0))
            # ignored rows: 0; the mean: 1 / n_valid
            logits.mul_((valid.to(acc) * scale)[:, None])
            g = through_cap(logits, capped, x.dtype)  # [C, V]
            del logits, capped
            head_back(g, xc, weight, dx[s : s + rows] if grad_x else None, dw)
            del g
    return total / n_valid.to(acc), dx, dw


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, ignore_index: int, rows: int, softcap):
        loss, dx, dw = _chunked(
            x, weight, targets, ignore_index, rows, ctx.needs_input_grad[0], ctx.needs_input_grad[1], softcap
        )
        ctx.save_for_backward(dx, dw)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        dx, dw = ctx.saved_tensors
        dx = None if dx is None else dx * grad_loss.to(dx.dtype)
        dw = None if dw is None else (dw * grad_loss).to(ctx.weight_dtype)
        return dx, dw, None, None, None, None


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of logits x @ weight^T (soft-capped to softcap * tanh(logits / softcap) when softcap
    is given) against targets, chunked over the tokens.

    x [..., d] (flattened to [N, d]), weight [V, d], targets [...] matching x's leading dims.
    Returns the fp32 mean over targets != ignore_index (NaN when there are none, as F.cross_entropy).
    """
    d = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight must be [vocab, {d}], got {tuple(weight.shape)}")
    if targets.shape != x.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must match x's leading dims {tuple(x.shape[:-1])}")
    x2 = x.reshape(-1, d)  # [N, d]
    t2 = targets.reshape(-1)  # [N]
    device = x.device.type
    # the matmuls in the autocast dtype, as F.linear would run them
    x2, w2 = matmul_operands(x2, weight)
    rows = chunk_rows(x2.shape[0], weight.shape[0], chunk_size)
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (x2.requires_grad or w2.requires_grad):
            return LinearCrossEntropy.apply(x2, w2, t2, int(ignore_index), rows, softcap)
        return _chunked(x2, w2, t2, int(ignore_index), rows, False, False, softcap)[0]


# ---- per-token log-probs of the targets (the preference and policy losses) ----------------------------


def _scaled_logits(xc, weight, acc, softcap, temperature):
    """(fp32 logits of one chunk: x @ weight^T, soft-capped, divided by temperature; the cap's tanh or
    None)."""
    logits = (xc @ weight.t()).to(acc)  # [C, V]
    capped = None
    if softcap is not None:
        capped = torch.tanh(logits / softcap)  # [C, V]
        logits = capped * softcap
    if temperature != 1.0:
        logits = logits / temperature
    return logits, capped


def _logps_forward(x, weight, targets, ignore_index: int, rows: int, softcap, temperature):
    """(log-probs [N] of the targets, 0 where ignored; log-sum-exp [N] of the scaled logits), chunk by
    chunk."""
    N = x.shape[0]
    acc = torch.promote_types(x.dtype, torch.float32)
    valid_all = targets != ignore_index  # [N]
    out = torch.empty(N, device=x.device, dtype=acc)  # [N]
    lse_all = torch.empty(N, device=x.device, dtype=acc)  # [N]
    for s in range(0, N, rows):
        valid = valid_all[s : s + rows]  # [C]
        tc = torch.where(valid, targets[s : s + rows], 0)  # [C]
        logits, _ = _scaled_logits(x[s : s + rows], weight, acc, softcap, temperature)  # [C, V]
        lse = torch.logsumexp(logits, dim=-1)  # [C]
        picked = logits.gather(1, tc[:, None])[:, 0]  # [C]
        del logits
        out[s : s + rows] = torch.where(valid, picked - lse, 0.0)
        lse_all[s : s + rows] = lse
    return out, lse_all


def through_cap(grad_logits, capped, dtype):
    """One chunk's gradient with respect to its logits, grad_logits [C, V] fp32 (scaled in place), taken back
    through the cap (`capped`: _scaled_logits' tanh, squared in place; None: no cap), in the matmuls' dtype.
    The caller then drops its fp32 chunk before head_back, so a half-precision run holds one copy."""
    # d(c tanh(z / c)) / dz = 1 - tanh(z / c)^2
    if capped is not None:
        grad_logits.mul_(capped.square_().neg_().add_(1.0))
    return grad_logits if grad_logits.dtype == dtype else grad_logits.to(dtype)  # [C, V]


def head_back(g, xc, weight, dx_rows, dw) -> None:
    """One chunk's logit gradient g [C, V] through the head: written into dx_rows [C, d] (None: not wanted),
    added to dw [V, d] (fp32; None: not wanted)."""
    if dx_rows is not None:
        torch.mm(g, weight, out=dx_rows)  # [C, d]
    if dw is not None:
        if g.dtype == dw.dtype:
            dw.addmm_(g.t(), xc)  # [V, d]
        else:
            # accumulated in fp32
            dw.add_(g.t() @ xc)


class LinearLogProbs(torch.autograd.Function):
    """Per-token log-probs of x @ weight^T's targets. The incoming gradient is one number per token, known
    only in the backward pass, so the backward recomputes each chunk's logits (one more head matmul) from the
    saved x, weight and log-sum-exp instead of keeping them: d logp_i / d logits_i = onehot(target_i) -
    softmax_i."""

    @staticmethod
    def forward(ctx, x, weight, targets, ignore_index: int, rows: int, softcap, temperature: float):
        out, lse = _logps_forward(x, weight, targets, ignore_index, rows, softcap, temperature)
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.args = (ignore_index, rows, softcap, temperature)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight, targets, lse_all = ctx.saved_tensors
        ignore_index, rows, softcap, temperature = ctx.args
        grad_x, grad_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse_all.dtype
        N = x.shape[0]
        # ignored targets get no gradient, whatever comes in
        grad = torch.where(targets != ignore_index, grad_out.to(acc), 0.0)  # [N]
        dx = torch.empty_like(x) if grad_x else None  # [N, d]
        dw = torch.zeros(weight.shape, device=weight.device, dtype=acc) if grad_w else None  # [V, d]
        with torch.autocast(x.device.type, enabled=False):
            for s in range(0, N, rows):
                xc = x[s : s + rows]  # [C, d]
                gc = grad[s : s + rows]  # [C]
                tc = torch.where(targets[s : s + rows] != ignore_index, targets[s : s + rows], 0)  # [C]
                logits, capped = _scaled_logits(xc, weight, acc, softcap, temperature)  # [C, V]
                # g (onehot - softmax), in place
                logits.sub_(lse_all[s : s + rows, None]).exp_().mul_(-gc[:, None])
                logits.scatter_add_(1, tc[:, None], gc[:, None])
                if temperature != 1.0:
                    logits.div_(temperature)
                g = through_cap(logits, capped, x.dtype)  # [C, V]
                del logits, capped
                head_back(g, xc, weight, None if dx is None else dx[s : s + rows], dw)
                del g
        return dx, None if dw is None else dw.to(weight.dtype), None, None, None, None, None


def linear_log_probs(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of the targets under logits = x @ weight^T (soft-capped to softcap * tanh(logits / softcap)
    when softcap is given, then divided by temperature), chunked over the tokens as linear_cross_entropy is:
    only one chunk of fp32 logits exists at a time, in the forward and in the backward pass.

    x [..., d], weight [V, d], targets [...] matching x's leading dims -> fp32 log-probs [...] (0 where a
    target is ignore_index), equal to -F.cross_entropy(logits.float() / temperature, targets,
    reduction="none"). Differentiable in x and weight for any function of the log-probs.
    """
    d = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight must be [vocab, {d}], got {tuple(weight.shape)}")
    if targets.shape != x.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must match x's leading dims {tuple(x.shape[:-1])}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    x2 = x.reshape(-1, d)  # [N, d]
    t2 = targets.reshape(-1)  # [N]
    device = x.device.type
    x2, w2 = matmul_operands(x2, weight)
    rows = chunk_rows(x2.shape[0], weight.shape[0], chunk_size)
    args = (int(ignore_index), rows, softcap, float(temperature))
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (x2.requires_grad or w2.requires_grad):
            out = LinearLogProbs.apply(x2, w2, t2, *args)
        else:
            out = _logps_forward(x2, w2, t2, *args)[0]
    return out.view(targets.shape)
