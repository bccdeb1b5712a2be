#!/usr/bin/env python3
"""objective=grpo's loss against TRL's GRPOTrainer on the same fixed log-probs (docs/grpo.md, "Checked").

TRL is not a dependency of gptkit: install it in an environment of its own and name its python.

    python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0 trl
    .venv/bin/python .ci/grpo_vs_trl.py --trl-python /tmp/trl-venv/bin/python

The TRL side (this file run with --side trl by TRL's python) calls GRPOTrainer._compute_loss on a trainer
made without __init__ (only the attributes the loss reads), with _get_per_token_logps_and_entropies replaced
by a stand-in that returns the fixed per-token log-probs (a leaf tensor, so the gradient can be read); it
writes the loss, the gradient with respect to the log-probs, TRL's logged clip ratio and KL, and the
advantages of TRL's formula (its nanstd, + 1e-4) as JSON. This side computes the same with
gptkit.training.objectives.grpo (grpo_loss, group_advantages) and prints the largest difference of each, for
loss_type grpo, dr_grpo and dapo, with and without a KL term (grpo.kl=k3 against use_bias_correction_kl=False,
k3_ratio against True, TRL 1.16's default), in the first pass (old = the log-probs, detached) and a later one;
and for grpo.loss=gspo against TRL's importance_sampling_level="sequence" with loss_type="grpo" (its clip
ratio counted over the completions), grpo.loss=cispo against loss_type="cispo" with TRL's epsilon_high = 1 +
gptkit's (TRL clips the IS weight at epsilon_high itself; its cispo_clip_ratio against the clip fraction). It
exits 1 when one differs by 1e-6 or more.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from types import SimpleNamespace

import torch

N, T, MAX_NEW, G = 12, 9, 9, 4
# (loss_type, epsilon_low, epsilon_high, beta, first pass, grpo.kl: k3 = TRL's use_bias_correction_kl=False,
# k3_ratio = True, TRL's default since 1.16)
# gspo: the GSPO paper's clip (3e-4, 4e-4) and a wider one; cispo: a clip that acts, and ScaleRL's 5 (4 here)
EPSILONS = {
    "gspo": ((3e-4, 4e-4, 0.0), (0.02, 0.03, 0.04)),
    "cispo": ((0.2, 0.28, 0.0), (0.2, 4.0, 0.04)),
}
CASES = [
    (loss, lo, hi, beta, first, kl)
    for loss in ("grpo", "dr_grpo", "dapo", "gspo", "cispo")
    for lo, hi, beta in EPSILONS.get(loss, ((0.2, 0.2, 0.0), (0.2, 0.28, 0.04)))
    for first in (True, False)
    for kl in (("k3", "k3_ratio") if beta else ("k3",))
]
# gptkit's grpo.loss -> TRL's (loss_type, importance_sampling_level)
TRL_LOSS = {"gspo": ("grpo", "sequence"), "cispo": ("cispo", "token")}


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Fixed per-token log-probs of N completions of at most T tokens (of the policy, the sampling policy and
    the reference), their mask (each completion 1..T tokens, right-padded), their advantages and rewards of
    N / G groups."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    old = logps + (torch.rand(N, T, generator=g, dtype=torch.float64) - 0.5) * 0.8
    ref = logps + (torch.rand(N, T, generator=g, dtype=torch.float64) - 0.5) * 0.6
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    advantages = torch.randn(N, generator=g, dtype=torch.float64)
    rewards = torch.randint(0, 3, (N // G, G), generator=g).double()
    rewards[0] = 1.0
    return dict(logps=logps, old=old, ref=ref, mask=mask, advantages=advantages, rewards=rewards)


def trl_side() -> dict:
    import trl
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import nanstd

    data = inputs()
    out = {"trl": trl.__version__, "cases": []}
    for loss_type, lo, hi, beta, first, kl in CASES:
        logps = data["logps"].clone().float().requires_grad_(True)
        trainer = GRPOTrainer.__new__(GRPOTrainer)
        trl_loss, level = TRL_LOSS.get(loss_type, (loss_type, "token"))
        trainer.__dict__.update(
            top_entropy_quantile=1.0,
            off_policy_mask_threshold=None,
            importance_sampling_level=level,
            beta=beta,
            loss_type=trl_loss,
            epsilon_low=lo,
            # TRL's cispo clips the IS weight at epsilon_high itself, gptkit's at 1 + epsilon_high
            epsilon_high=1 + hi if loss_type == "cispo" else hi,
            use_vllm=False,
            aux_loss_enabled=False,
            _entropy_bonus_enabled=False,
            max_completion_length=MAX_NEW,
            current_gradient_accumulation_steps=1,
            model=SimpleNamespace(training=True),
            args=SimpleNamespace(use_bias_correction_kl=kl == "k3_ratio", delta=None, steps_per_generation=1),
            accelerator=SimpleNamespace(
                num_processes=1,
                gather=lambda x: x,
                reduce=lambda x, reduction: x,
                gather_for_metrics=lambda x: x,
            ),
            _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        )
        trainer._get_per_token_logps_and_entropies = lambda *a, lp=logps, **k: (
            lp,
            torch.zeros_like(lp),
            None,
        )
        batch = {
            "prompt_ids": torch.zeros(N, 1, dtype=torch.long),
            "prompt_mask": torch.ones(N, 1, dtype=torch.long),
            "completion_ids": torch.zeros(N, T, dtype=torch.long),
            "completion_mask": data["mask"].long(),
            "advantages": data["advantages"].float(),
            "num_items_in_batch": data["mask"].sum(),
        }
        if not first:
            batch["old_per_token_logps"] = data["old"].float()
        if beta:
            batch["ref_per_token_logps"] = data["ref"].float()
        loss = trainer._compute_loss(None, batch)
        loss.backward()
        m = trainer._metrics["train"]
        out["cases"].append(
            {
                "loss": float(loss),
                "grad": logps.grad.tolist(),
                "clip": m["cispo_clip_ratio" if loss_type == "cispo" else "clip_ratio/region_mean"][0],
                "kl": m["kl"][0] if beta else None,
            }
        )
    # TRL's advantages (GRPOTrainer._generate_and_score_completions with scale_rewards "group" and "none")
    r = data["rewards"].flatten()
    mean = torch.nanmean(r.view(-1, G), dim=1).repeat_interleave(G)
    std = nanstd(r.view(-1, G), dim=1).repeat_interleave(G)
    out["advantages"] = {"std": ((r - mean) / (std + 1e-4)).tolist(), "none": (r - mean).tolist()}
    return out


def compare(trl: dict) -> int:
    from gptkit.training.objectives.grpo import group_advantages, grpo_loss

    data = inputs()
    worst = defaultdict(float)
    for (loss_type, lo, hi, beta, first, kl), want in zip(CASES, trl["cases"]):
        logps = data["logps"].clone().float().requires_grad_(True)
        old = logps.detach() if first else data["old"].float()
        value, figures = grpo_loss(
            logps,
            old,
            data["advantages"].float(),
            data["mask"].bool(),
            epsilon_low=lo,
            epsilon_high=hi,
            beta=beta,
            ref_logps=data["ref"].float() if beta else None,
            loss=loss_type,
            max_new_tokens=MAX_NEW,
            kl=kl,
        )
        value.backward()
        name = f"{loss_type:7s} eps {lo}/{hi} beta {beta:<4} {kl:8s} {'first' if first else 'later'} pass"
        d_loss = abs(float(value.detach()) - want["loss"])
        d_grad = float((logps.grad.double() - torch.tensor(want["grad"], dtype=torch.float64)).abs().max())
        units = figures.get("clip_units", figures["tokens"])
        d_clip = abs(float(figures["clipped"] / units) - want["clip"])
        d_kl = abs(float(figures["kl"] / figures["tokens"]) - want["kl"]) if beta else 0.0
        print(
            f"{name}: loss {float(value.detach()):+.8f} vs TRL {want['loss']:+.8f}  |d| loss {d_loss:.1e} "
            f"grad {d_grad:.1e} clip {d_clip:.1e} kl {d_kl:.1e}"
        )
        for k, v in (("loss", d_loss), ("grad", d_grad), ("clip fraction", d_clip), ("kl", d_kl)):
            worst[k] = max(worst[k], v)
    rewards = data["rewards"].float()
    for scale in ("std", "none"):
        got = group_advantages(rewards, scale).flatten().double()
        d = float((got - torch.tensor(trl["advantages"][scale], dtype=torch.float64)).abs().max())
        print(f"advantages scale={scale}: |d| {d:.1e}")
        worst[f"advantages ({scale})"] = d
    print(
        f"TRL {trl['trl']}, torch {torch.__version__}: largest |difference| "
        + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    )
    return 0 if max(worst.values()) < 1e-6 else 1


if __name__ == "__main__":
    from trl_pair import main

    sys.exit(main(__file__, __doc__, trl_side, compare))
