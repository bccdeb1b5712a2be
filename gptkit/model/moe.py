"""A mixture-of-experts feed-forward (model.moe): top-k token-choice routing, dropless, grouped matmuls.

    x [B, T, d] -> h [N, d]                                 N = B * T tokens
    router    logits = h W_r^T (+ b_r: model.moe.router_bias) [N, E]; scores = softmax | sigmoid   (fp32)
    choice    the top_k experts of each token by score (+ expert_bias, when model.moe.bias_update_rate > 0
              or model.moe.correction_bias: the bias moves the choice only, never the weights)   [N, k]
              with model.moe.n_group > 1 (DeepSeek-V3's group-limited routing) among the experts of the
              topk_group groups only, a group scored by the sum of its two best choice scores
    weights   the chosen scores, renormalized to sum 1 (norm_topk_prob), times route_scale
    dispatch  the N * k (token, expert) pairs sorted by expert (a stable sort), and where each expert's run
              of rows ends (offsets): no token is dropped, no capacity, no padding
    experts   a gated MLP per expert, one grouped matmul per weight: down_e(act(gate_e(x), up_e(x))), act
              SwiGLU's silu(g) * u or gpt-oss's clamped one (EXPERT_ACTIVATIONS), each projection with its
              expert's bias under model.moe.expert_biases (torch._grouped_mm where the device has it, else a
              loop over the experts; MOE_IMPLS)
    combine   each token's k outputs gathered back and summed with their weights (in fp32, in slot order:
              deterministic on every device), plus the n_shared always-on experts' SwiGLU of every token
              (times sigmoid(h W_s), W_s [1, d], under model.moe.shared_expert_gate: Qwen3-Next's)

In training it also returns its auxiliary loss and figures (LayerAux, MoEStats): the Switch/GShard balance
loss E * sum_i f_i * P_i (f_i: the share of the group's token-expert assignments that go to expert i, P_i:
the mean router probability of i; 1 when balanced, E / k when every token picks the same k experts), taken
per sequence (aux_loss_group=sequence: independent of how a step's sequences are split over micro-batches and
ranks) or over the micro-batch; the router z-loss mean(logsumexp(logits)^2) (ST-MoE); the tokens per expert
and the router entropy. The expert bias (DeepSeek-V3's auxiliary-loss-free balancing) is a buffer, moved by
the training loop once per optimizer step from that step's loads (update_bias).

The maths is that of transformers' Mixtral, Qwen3-MoE and OLMoE (softmax in fp32, top-k, renormalized or
not) and torchtitan's models/moe (sigmoid scores, the expert bias); the weights keep transformers' per-expert
layout: gate_proj and up_proj [E, d_expert, d_model], down_proj [E, d_model, d_expert].
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gptkit.model import fused
from gptkit.model.config import ModelConfig
from gptkit.model.layers import LayerAux, SwiGLUMLP


class MoEStats(NamedTuple):
    """What one MoE layer reports of a training forward (detached; the training loop sums or averages it)."""

    # scalar: E * sum_i f_i * P_i, the mean over the groups (1 = balanced)
    balance: torch.Tensor
    # scalar: mean over tokens of logsumexp(router logits)^2
    z: torch.Tensor
    # scalar: mean over tokens of the router distribution's entropy, in nats (0: collapsed; log E: uniform)
    entropy: torch.Tensor
    # [E] float32: token-expert assignments per expert (every token counts top_k times)
    counts: torch.Tensor


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs here: this torch has it, and the tensor is on the CPU, or on a CUDA GPU
    of compute capability 9.0 or later in bf16 (torch's kernel; not measured on a GPU here)."""
    if not hasattr(torch, "_grouped_mm") or _traced_without_bf16(x):
        return False
    if x.device.type == "cpu":
        return True
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def _traced_without_bf16(x: torch.Tensor) -> bool:
    """torch.compile traces torch._grouped_mm through its meta kernel, which takes bf16 only (CUDA's rule),
    though the CPU's eager kernel runs fp32: a compiled fp32 model takes the loop."""
    return torch.compiler.is_compiling() and x.dtype != torch.bfloat16


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor, impl: str
) -> torch.Tensor:
    """x [M, in] (rows sorted by expert; expert e's rows end at offsets[e]) times each expert's weight
    [E, out, in] transposed -> [M, out]. impl grouped_mm: one torch._grouped_mm (the loop when torch.compile
    traces it in another dtype than bf16); loop: one matmul per expert (reads `counts` on the host); auto:
    grouped_mm where grouped_mm_available, else loop. Under autocast both
    run in the autocast dtype, as nn.Linear does."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        x, weight = x.to(dtype), weight.to(dtype)
    grouped = impl == "grouped_mm" and not _traced_without_bf16(x)
    if grouped or (impl == "auto" and grouped_mm_available(x)):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    parts = [F.linear(rows, weight[e]) for e, rows in enumerate(x.split(counts.tolist()))]  # [n_e, out] each
    return torch.cat(parts)  # [M, out]


def swiglu(gate: torch.Tensor, up: torch.Tensor, m: Any) -> torch.Tensor:
    """silu(gate) * up (Mixtral, Qwen, OLMoE, DeepSeek)."""
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, m: Any) -> torch.Tensor:
    """gpt-oss's: g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g)."""
    g = gate.clamp(max=m.swiglu_limit)
    u = up.clamp(min=-m.swiglu_limit, max=m.swiglu_limit)
    return (u + 1) * g * torch.sigmoid(g * m.swiglu_alpha)


# model.moe.activation -> (gate [M, d_expert], up [M, d_expert], model.moe) -> [M, d_expert]
EXPERT_ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]] = {
    "swiglu": swiglu,
    "clamped_swiglu": clamped_swiglu,
}
# the experts' stacks, weights then biases (a name of a bias stack ends in _bias)
BIASES = ("gate_bias", "up_bias", "down_bias")


class Experts(nn.Module):
    """E gated experts, their weights stacked: gate_proj, up_proj [E, d_expert, d_model], down_proj
    [E, d_model, d_expert] (each expert's slice laid out as an nn.Linear weight, [out, in]); with
    model.moe.expert_biases their biases gate_bias, up_bias [E, d_expert] and down_bias [E, d_model]."""

    def __init__(
        self, n_experts: int, d_model: int, d_expert: int, impl: str, fused_swiglu: bool, m=None
    ) -> None:
        super().__init__()
        self.impl = impl
        activation = "swiglu" if m is None else m.activation
        self.moe_cfg, self.activate = m, EXPERT_ACTIVATIONS[activation]
        self.fused = fused_swiglu and activation == "swiglu"
        self.gate_proj = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.up_proj = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, d_expert))
        self.biased = m is not None and m.expert_biases
        if self.biased:
            self.gate_bias = nn.Parameter(torch.zeros(n_experts, d_expert))
            self.up_bias = nn.Parameter(torch.zeros(n_experts, d_expert))
            self.down_bias = nn.Parameter(torch.zeros(n_experts, d_model))

    def weight(self, name: str) -> torch.Tensor:
        """The stack `name` as this process computes with it, [E, out, in] (a bias [E, out]). Expert
        parallelism (gptkit/training/expert_parallel.py) gives its instances this rank's experts instead."""
        return getattr(self, name)

    def project(
        self, x: torch.Tensor, name: str, offsets: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """x [M, in] sorted by expert through each expert's `name` weight (and its bias) -> [M, out] (LoRA
        adds its update here: gptkit/training/finetune/lora.py)."""
        y = grouped_linear(x, self.weight(name), offsets, counts, self.impl)
        if self.biased:
            bias = self.weight(name.replace("_proj", "_bias"))  # [E, out]
            # each row its expert's bias (output_size: no host sync)
            y = y + bias.to(y.dtype).repeat_interleave(counts, dim=0, output_size=x.shape[0])  # [M, out]
        return y

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [M, d_model] sorted by expert -> each row through its expert's gated MLP [M, d_model]."""
        gate = self.project(x, "gate_proj", offsets, counts)  # [M, d_expert]
        up = self.project(x, "up_proj", offsets, counts)  # [M, d_expert]
        if self.fused and fused.usable(gate, "swiglu"):
            hidden = fused.swiglu(gate, up)
        else:
            hidden = self.activate(gate, up, self.moe_cfg)  # [M, d_expert]
        return self.project(hidden, "down_proj", offsets, counts)  # [M, d_model]


def limit_to_groups(chooser: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3, transformers' DeepseekV3TopkRouter): chooser [N, E] with every
    expert outside each token's topk_group best groups at -inf. The E experts form n_group contiguous
    groups; a group's score is the sum of its two highest choice scores."""
    N, E = chooser.shape
    grouped = chooser.view(N, n_group, E // n_group)  # [N, G, E / G]
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
    kept = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices  # [N, topk_group]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [N, G]
    return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(N, E)


class MoE(nn.Module):
    """The mixture-of-experts feed-forward of one layer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        m = cfg.moe
        self.n_experts, self.top_k = m.n_experts, m.top_k
        self.router_kind, self.norm_topk_prob, self.route_scale = m.router, m.norm_topk_prob, m.route_scale
        self.aux_loss_coef, self.z_loss_coef = float(m.aux_loss_coef), float(m.z_loss_coef)
        self.per_sequence = m.aux_loss_group == "sequence"
        self.bias_update_rate = float(m.bias_update_rate)
        self.n_group, self.topk_group = m.n_group, m.topk_group
        self.router = nn.Linear(cfg.d_model, m.n_experts, bias=m.router_bias)
        self.experts = Experts(m.n_experts, cfg.d_model, m.d_expert, m.impl, "swiglu" in cfg.kernels, m)
        self.shared = (
            SwiGLUMLP(cfg.d_model, m.n_shared * m.d_expert, bias=False, fused="swiglu" in cfg.kernels)
            if m.n_shared
            else None
        )
        # model.moe.shared_expert_gate: the shared experts' output times sigmoid(h W_s) (Qwen3-Next)
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if m.shared_expert_gate else None
        # [E] fp32, moved by update_bias (bias_update_rate > 0) or fixed (model.moe.correction_bias: an
        # imported DeepSeek-V3's e_score_correction_bias); part of the state dict (a resume continues it)
        if self.bias_update_rate > 0 or m.correction_bias:
            self.register_buffer("expert_bias", torch.zeros(m.n_experts))
        else:
            self.expert_bias = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [N, d] -> (router logits [N, E], fp32 scores [N, E], the chosen experts [N, k], their weights
        [N, k])."""
        logits = self.router(h)  # [N, E]
        if self.router_kind == "softmax":
            scores = torch.softmax(logits.float(), -1)  # [N, E]
        else:
            scores = logits.float().sigmoid()
        chooser = scores if self.expert_bias is None else scores + self.expert_bias.float()  # [N, E]
        if self.n_group > 1:
            chooser = limit_to_groups(chooser, self.n_group, self.topk_group)
        chosen = torch.topk(chooser, self.top_k, dim=-1).indices  # [N, k]
        weights = scores.gather(-1, chosen)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return logits, scores, chosen, weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, LayerAux | None]:
        """x [B, T, d_model] -> (y [B, T, d_model], its LayerAux in training, else None)."""
        B, T, d = x.shape
        h = x.reshape(B * T, d)  # [N, d]
        logits, scores, chosen, weights = self.route(h)
        k = self.top_k
        flat = chosen.reshape(-1)  # [N*k]: the expert of each (token, slot)
        # stable: an expert's rows keep the tokens' order
        order = torch.argsort(flat, stable=True)  # [N*k]
        counts = torch.bincount(flat, minlength=self.n_experts)  # [E]
        offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E]: where each expert's rows end
        rows = self.experts(h[order // k], offsets, counts)  # [N*k, d]
        # back to (token, slot) order: where each pair went in the sort
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        routed = rows[back].view(B * T, k, d)  # [N, k, d]
        y = (routed.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)  # [N, d]
        if self.shared is not None:
            shared = self.shared(h)[0]  # [N, d]
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(h)) * shared
            y = y + shared
        y = y.view(B, T, d)
        if not self.training:
            return y, None
        return y, self.aux(logits, scores, chosen, counts, B)

    def aux(self, logits, scores, chosen, counts, batch: int) -> LayerAux:
        """The auxiliary loss (weighted) and figures of one training forward (see the module docstring)."""
        E, k = self.n_experts, self.top_k
        # the router's distribution: softmax probabilities, or the sigmoid scores normalized (DeepSeek-V3)
        probs = scores if self.router_kind == "softmax" else scores / scores.sum(-1, keepdim=True)  # [N, E]
        groups = batch if self.per_sequence else 1
        picked = torch.zeros_like(probs).scatter_(-1, chosen, 1.0)  # [N, E]
        share = picked.view(groups, -1, E).mean(1) / k  # [G, E]: f_i, each row sums to 1
        mean_prob = probs.view(groups, -1, E).mean(1)  # [G, E]: P_i
        balance = E * (share * mean_prob).sum(-1).mean()
        z = torch.logsumexp(logits.float(), -1).square().mean()
        loss = self.aux_loss_coef * balance + self.z_loss_coef * z
        with torch.no_grad():
            entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1).mean()
        stats = MoEStats(balance.detach(), z.detach(), entropy, counts.detach().float())
        return LayerAux(loss, stats)

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """After an optimizer step: each expert's bias moves by bias_update_rate towards balance, down for an
        expert above the mean load, up below it (DeepSeek-V3), centred to mean 0 (torchtitan; the choice is
        unchanged by a common shift). counts [E]: the step's token-expert assignments over every micro-batch
        and rank, so every rank moves its copy the same way."""
        if self.expert_bias is None or not self.bias_update_rate:
            return
        counts = counts.to(self.expert_bias.device, torch.float32)
        step = self.bias_update_rate * torch.sign(counts.mean() - counts)  # [E]
        self.expert_bias.add_((step - step.mean()).to(self.expert_bias.dtype))
