"""objective=distill against a precomputed teacher (distill.teacher=precomputed): the teacher's top-k.

`gptkit prepare data=chat ... teacher=<run> top_k=k` keeps, at every label position of every training row,
the teacher's k most likely next tokens and their log-probs (at temperature 1, over the whole vocabulary:
log t_v). Training then holds no teacher and, with tau the temperature, reads

    t~_v = exp(log t_v / tau) / sum_{u in top-k} exp(log t_u / tau)   for v in the top-k, 0 elsewhere
    D_k  = KL(t~ || s) = sum_{v in top-k} t~_v (log t~_v - log s_v),  s = softmax(student logits / tau)
                                                                        over the whole vocabulary

the forward KL to the teacher truncated to its top-k and renormalized (softmax(logits / tau) restricted to a
set is the same whether computed from the logits or from the log-probs: the normalizer cancels). The student
is not renormalized: D_k is a true KL over the whole vocabulary, 0 only where the student puts all its mass
on the top-k as t~ does, and D_k equals the full forward KL exactly when the teacher's mass outside its top-k
is 0 (k = the vocabulary size: tests/training/test_distill.py). It is not the full-vocabulary loss
otherwise: the teacher's tail (1 - sum of its top-k probabilities) is dropped and its top-k scaled up to 1.
Only the forward KL (distill.beta=0) is defined this way: the reverse KL and the JSD read the teacher's
probability of every token the student may put mass on.

Others: Arcee's DistillKit stores sparse top-k teacher logits for offline distillation; implementations
differ in whether the k log-probs are renormalized, left unnormalized, or completed with the tail as one
extra bucket; "Sparse Logit Sampling" (Anshumann et al. 2025, arXiv:2503.16870) shows that caching the top-k
biases the teacher's estimate and proposes sampled tokens instead. gptkit renormalizes (the choice above).

A step computes it with chunked_topk_distill_loss, from the student's final hidden states and head chunk by
chunk over the label positions (gptkit_kernels.linear_distill.linear_topk_distill: no [B, T, vocab] logits in
either pass); topk_distill_loss, on whole logits, is the readable reference the tests hold it to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gptkit.model import fused


def topk_divergence(
    student_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logps: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """D_k of each position (module docstring): student logits [..., V], the teacher's top-k ids [..., k]
    (int64) and log-probs [..., k] -> [...], in fp32 (or wider); the gradient flows to the student's
    logits."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    s = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)  # [..., V]
    t = F.log_softmax(teacher_logps.to(dtype) / temperature, dim=-1)  # [..., k] log t~
    return (t.exp() * (t - s.gather(-1, teacher_ids))).sum(-1)


def topk_distill_loss(
    student_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logps: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha * CE + (1 - alpha) * D_k, CE, D_k), each the mean over the label positions (targets [N, T] !=
    -100) of logits [N, T, V] against the teacher's top-k [N, T, k]; as distill_loss, CE and D_k detached."""
    mask = targets != -100  # [N, T]
    s = student_logits[mask]  # [M, V]
    n = mask.sum().clamp(min=1)
    d = topk_divergence(s, teacher_ids[mask].long(), teacher_logps[mask], temperature).sum() / n
    ce = (
        F.cross_entropy(s.to(torch.promote_types(s.dtype, torch.float32)), targets[mask], reduction="sum") / n
    )
    return alpha * ce + (1.0 - alpha) * d, ce.detach(), d.detach()


def chunked_topk_distill_loss(
    model: torch.nn.Module,
    x: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logps: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    alpha: float = 0.0,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_distill_loss's (loss, CE, D_k) of `model` on x [N, T] against the teacher's top-k [N, T, k],
    computed inside the model's forward (GPT.forward(head=...)) from its final hidden states and head, chunk
    by chunk over the label positions: no [N, T, vocab] logits in either pass."""

    def head(h, weight, softcap):
        return fused.linear_topk_distill(
            h,
            weight,
            teacher_ids,
            teacher_logps,
            targets,
            temperature=temperature,
            alpha=alpha,
            softcap=softcap,
        )

    return model(x, doc_ids=doc_ids, head=head).head
