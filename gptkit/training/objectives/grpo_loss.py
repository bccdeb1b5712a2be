"""GRPO's loss, apart from its objective (grpo.py): the settings check, the group-relative advantages and
the policy loss of every `grpo.loss` (grpo, dr_grpo, dapo, gspo, cispo) on per-token log-probs. grpo.py's
docstring gives the formulas; tests/training/test_grpo.py and .ci/grpo_vs_trl.py hold them to the papers
and to TRL."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from gptkit.errors import ConfigError
from gptkit.evaluation.sampled import check_ks
from gptkit.inference.rollouts import RolloutOptions
from gptkit.training.rewards import parse_rewards, reward_timeout

LOSSES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo")
# the losses normalized by the step's completion tokens (each micro-batch weighs its tokens)
TOKEN_MEAN = ("dapo", "cispo")
SCALES = ("std", "none")
# grpo.kl: the per-token KL term, k3 alone, or k3 times the ratio rho (TRL's use_bias_correction_kl)
KLS = ("k3", "k3_ratio")
# added to a group's std before dividing (TRL's GRPOTrainer adds the same)
STD_EPS = 1e-4


def check_grpo_config(g: Any) -> None:
    """The grpo block: one-line ConfigErrors for values that cannot train (the rewards: parse_rewards)."""
    if g is None:
        raise ConfigError("objective=grpo needs its grpo block (conf/train.yaml)")
    n = g.get("group_size")
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ConfigError(
            f"grpo.group_size={n!r} must be an integer >= 2: the completions of one prompt, whose mean "
            "reward is the baseline of each"
        )
    for key, low in (("max_new_tokens", 1), ("iterations", 1)):
        v = g.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ConfigError(f"grpo.{key}={v!r} must be an integer >= {low}")
    if str(g.get("scale")) not in SCALES:
        raise ConfigError(f"grpo.scale={g.get('scale')!r} is not one of {', '.join(SCALES)}")
    if str(g.get("loss")) not in LOSSES:
        raise ConfigError(f"grpo.loss={g.get('loss')!r} is not one of {', '.join(LOSSES)}")
    if str(g.get("kl", "k3")) not in KLS:
        raise ConfigError(
            f"grpo.kl={g.get('kl')!r} is not one of {', '.join(KLS)} (k3: the KL estimate alone; k3_ratio: "
            "times the ratio to the sampling policy, TRL's use_bias_correction_kl)"
        )
    reward_timeout(g.get("reward_timeout"))
    check_is_correction(g.get("is_correction"))
    invariant = g.get("batch_invariant")
    if invariant is not None and not isinstance(invariant, bool):
        raise ConfigError(
            f"grpo.batch_invariant={invariant!r} must be true or false (true: the sampler's and the "
            "trainer's forwards in gptkit.model.batch_invariant's ops: equal log-probs in fp32 on the CPU)"
        )
    eps, high = g.get("epsilon"), g.get("epsilon_high")
    for key, v in (("epsilon", eps), ("epsilon_high", high)):
        if v is not None and not (isinstance(v, (int, float)) and 0 < float(v) < 1e3):
            raise ConfigError(f"grpo.{key}={v!r} must be > 0 (the clip of the ratio: 0.2 is usual)")
    if eps is None or float(eps) >= 1:
        raise ConfigError(f"grpo.epsilon={eps!r} must be in (0, 1): the ratio is clipped at 1 - epsilon")
    beta = g.get("beta")
    if not isinstance(beta, (int, float)) or not 0 <= float(beta) < math.inf:
        raise ConfigError(f"grpo.beta={beta!r} must be >= 0 (the weight of the KL to the start; 0: none)")
    RolloutOptions(
        int(g.max_new_tokens), float(g.temperature), g.get("top_k") or None, float(g.get("top_p", 1.0))
    ).validate()
    if float(g.temperature) <= 0:
        raise ConfigError(
            "grpo.temperature must be > 0: a group of greedy completions is one completion G times, whose "
            "advantages are all 0"
        )
    if float(g.get("val_temperature", 0.0)) < 0:
        raise ConfigError(f"grpo.val_temperature={g.get('val_temperature')} must be >= 0 (0: greedy)")
    n, _ = check_ks(g.get("val_k"), g.get("val_samples", 1), "grpo.val_samples", "grpo.val_k")
    if n > 1 and not float(g.get("val_temperature") or 0.0) > 0:
        raise ConfigError(
            f"grpo.val_samples={n} needs grpo.val_temperature > 0: {n} greedy completions of a prompt are "
            f"one completion {n} times"
        )
    parse_rewards(g.get("rewards"))


def check_is_correction(cap: Any) -> float | None:
    """grpo.is_correction: None (off) or the cap of the truncated importance-sampling weight, a number > 0."""
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < float(cap) < math.inf:
        raise ConfigError(
            f"grpo.is_correction={cap!r} must be null (off) or the cap of the truncated importance-sampling "
            "weight min(exp(trainer - sampler log-prob), cap), a number > 0 (e.g. 2)"
        )
    return float(cap)


def is_weights(old_logps: torch.Tensor, sampled_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling [N, T] (TRL's vllm_importance_sampling_mode="token_truncate", verl's
    TIS): min(exp(old - sampled), cap) per token, detached, where old is the trainer's log-prob of the weights
    that sampled and sampled the sampler's own. It corrects the policy term for tokens drawn from a sampler
    whose numbers are not the trainer's (bf16, another backend, a batch-variant decode)."""
    return torch.clamp(torch.exp(old_logps.detach() - sampled_logps.detach()), max=cap)


def group_advantages(rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """Advantages [P, G] of rewards [P, G] (P prompts, G completions each): the reward minus its group's mean,
    divided by (the group's unbiased std + STD_EPS) with scale=std."""
    adv = rewards - rewards.mean(dim=1, keepdim=True)  # [P, G]
    if scale == "std":
        adv = adv / (rewards.std(dim=1, keepdim=True) + STD_EPS)
    return adv


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [N, T] (fp32) of targets [N, T] under logits [N, T, V] divided by the sampling temperature
    (the policy that samples, as TRL's GRPOTrainer scores it); 0 where a target is -100. From whole logits
    (the tests' unchunked reference); the objective reads target_logps instead, chunked over the tokens."""
    n, t, v = logits.shape
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature
    return -F.cross_entropy(
        logits.reshape(n * t, v), targets.reshape(n * t), ignore_index=-100, reduction="none"
    ).view(n, t)


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    loss: str = "grpo",
    max_new_tokens: int | None = None,
    kl: str = "k3",
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the loss of a batch of completions, its figures) from per-token log-probs [N, T] of the policy, of the
    policy that sampled (old_logps) and of the reference (with beta > 0), advantages [N] and the completion
    tokens' mask [N, T] (see the module docstring). The figures are detached sums over the completion tokens:
    tokens, clipped (low: rho < 1 - epsilon_low with A < 0; high: rho > 1 + epsilon_high with A > 0; gspo:
    completions, over clip_units = the completions; cispo: rho > 1 + epsilon_high with A > 0, as TRL counts
    them), kl (the KL term as the loss has it: k3, or k3 x rho with kl="k3_ratio"). is_weight [N, T]
    (grpo.is_correction, is_weights): the policy term of each token times it, before the KL term is added
    (as TRL's GRPOTrainer applies importance_sampling_ratio)."""
    if loss not in LOSSES:
        raise ConfigError(f"grpo.loss={loss!r} is not one of {', '.join(LOSSES)}")
    mask = mask.to(logps.dtype)
    adv = advantages[:, None].to(logps.dtype)  # [N, 1]
    if loss == "gspo":
        # [N, 1] the sequence-level ratio: exp of the mean token log-ratio over the completion
        log_ratio = ((logps - old_logps) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        ratio = torch.exp(log_ratio)[:, None]
    else:
        ratio = torch.exp(logps - old_logps)  # [N, T]
    if loss == "cispo":
        weight = torch.clamp(ratio, max=1 + epsilon_high).detach()  # [N, T]
        per_token = -weight * adv * logps
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)  # [N, T] or [N, 1]
        per_token = -torch.min(ratio * adv, clipped * adv)  # [N, T] or [N, 1]
    if is_weight is not None:
        per_token = per_token * is_weight  # [N, T]
    figures = {"tokens": mask.sum().detach()}
    if kl not in KLS:
        raise ConfigError(f"grpo.kl={kl!r} is not one of {', '.join(KLS)}")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs the reference's log-probs")
    if ref_logps is not None:
        d = ref_logps - logps  # [N, T]
        term = torch.exp(d) - d - 1  # [N, T] k3, >= 0
        if kl == "k3_ratio":
            # TRL's use_bias_correction_kl: times the unclipped ratio, not detached (its gradient acts even
            # where rho = 1)
            term = term * ratio
        if beta > 0:
            per_token = per_token + beta * term
        figures["kl"] = (term * mask).sum().detach()
    high = (ratio > 1 + epsilon_high) & (adv > 0)
    low = (ratio < 1 - epsilon_low) & (adv < 0) if loss != "cispo" else torch.zeros_like(high)
    if loss == "gspo":
        # a completion's ratio is clipped as a whole: the share of completions
        figures["clipped"] = (low | high).to(mask.dtype).sum().detach()
        figures["clip_units"] = mask.new_tensor(float(mask.shape[0]))
    else:
        figures["clipped"] = ((low | high).to(mask.dtype) * mask).sum().detach()
    summed = (per_token * mask).sum(dim=1)  # [N]
    if loss in ("grpo", "gspo"):
        value = (summed / mask.sum(dim=1).clamp(min=1.0)).mean()
    elif loss == "dr_grpo":
        if not max_new_tokens:
            raise ValueError("dr_grpo needs max_new_tokens")
        value = summed.sum() / (summed.numel() * max_new_tokens)
    else:  # TOKEN_MEAN
        value = summed.sum() / mask.sum().clamp(min=1.0)
    return value, figures
