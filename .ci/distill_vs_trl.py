#!/usr/bin/env python3
"""objective=distill's divergence against TRL's GKDTrainer.generalized_jsd_loss on the same fixed logits
(docs/distillation.md, "Against TRL").

TRL is not a dependency of gptkit: install it in an environment of its own and name its python.

    python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0 trl
    .venv/bin/python .ci/distill_vs_trl.py --trl-python /tmp/trl-venv/bin/python

The TRL side (this file run with --side trl by TRL's python) calls the static method
trl.experimental.gkd.GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta,
temperature, reduction="batchmean") on fixed fp32 logits [N, T, V] (a leaf tensor: the gradient with respect
to the student's logits is read) with labels -100 on a padded row end and a prompt, and writes the losses and
gradients as JSON. This side computes gptkit.training.objectives.distill.distill_loss with alpha=0 (the
divergence alone: TRL's loss has no label term) on the same tensors and prints the largest difference; it
exits 1 when one differs by 1e-6 or more relative to max(1, |TRL's value|).
"""

from __future__ import annotations

import sys

import torch

N, T, V = 3, 9, 13
# (beta, temperature)
CASES = [(0.0, 1.0), (0.0, 2.0), (0.1, 1.0), (0.5, 1.0), (0.5, 0.7), (0.9, 2.0), (1.0, 1.0), (1.0, 2.0)]


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    student = torch.randn(N, T, V, generator=g) * 3
    teacher = torch.randn(N, T, V, generator=g) * 3
    labels = torch.randint(0, V, (N, T), generator=g)
    labels[0, 6:] = -100  # a padded row end
    labels[1, :2] = -100  # a prompt
    return {"student": student, "teacher": teacher, "labels": labels}


def trl_side() -> dict:
    import trl
    from trl.experimental.gkd import GKDTrainer

    data, out = inputs(), {"trl": trl.__version__, "cases": []}
    for beta, temperature in CASES:
        leaf = data["student"].clone().requires_grad_(True)
        loss = GKDTrainer.generalized_jsd_loss(
            leaf, data["teacher"], labels=data["labels"], beta=beta, temperature=temperature
        )
        loss.backward()
        out["cases"].append({"loss": float(loss), "grad": leaf.grad.tolist()})
    return out


def rel(ours: float, theirs: float) -> float:
    """|ours - theirs| / max(1, |theirs|)."""
    return abs(ours - theirs) / max(1.0, abs(theirs))


def compare(trl: dict) -> int:
    from gptkit.training.objectives.distill import distill_loss

    data, worst = inputs(), {"loss": 0.0, "grad": 0.0}
    for (beta, temperature), want in zip(CASES, trl["cases"]):
        leaf = data["student"].clone().requires_grad_(True)
        loss = distill_loss(leaf, data["teacher"], data["labels"], beta, temperature, alpha=0.0)[0]
        loss.backward()
        theirs = torch.tensor(want["grad"])
        d_loss = rel(float(loss.detach()), want["loss"])
        d_grad = float((leaf.grad - theirs).abs().max()) / max(1.0, float(theirs.abs().max()))
        print(
            f"beta {beta:<4} temperature {temperature:<4} loss {float(loss.detach()):.6f} "
            f"(TRL {want['loss']:.6f}) loss {d_loss:.1e} grad {d_grad:.1e}"
        )
        worst = {"loss": max(worst["loss"], d_loss), "grad": max(worst["grad"], d_grad)}
    print(
        f"TRL {trl['trl']}, torch {torch.__version__}: largest |difference| / max(1, |TRL's|) "
        + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    )
    return 0 if max(worst.values()) < 1e-6 else 1


if __name__ == "__main__":
    from trl_pair import main

    sys.exit(main(__file__, __doc__, trl_side, compare))
