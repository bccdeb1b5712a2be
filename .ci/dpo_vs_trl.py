#!/usr/bin/env python3
"""objective=dpo's losses against TRL's trainers on the same fixed log-probs (docs/dpo.md, "Against TRL").

TRL is not a dependency of gptkit: install it in an environment of its own and name its python.

    python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0 trl
    .venv/bin/python .ci/dpo_vs_trl.py --trl-python /tmp/trl-venv/bin/python

The TRL side (this file run with --side trl by TRL's python) calls each trainer's own loss on a trainer made
without __init__ (only the attributes the loss reads) and a stand-in model that returns fixed tensors (leaf
tensors, so the gradient can be read), and writes the losses, gradients and rewards as JSON:

  sigmoid, hinge, ipo   DPOTrainer._compute_loss (its precomputed-reference path), the stand-in returning
                        fixed per-token log-probs [2P, T] (0 outside the answers); the gradient is with
                        respect to those log-probs
  simpo                 CPOTrainer.get_batch_loss_metrics with loss_type="simpo", cpo_alpha=0 (no NLL
                        term), the stand-in returning fixed logits [2P, T, V]; the gradient is with respect
                        to the logits
  orpo                  ORPOTrainer.get_batch_loss_metrics (beta = dpo.lambda), the same logits; its NLL
                        is the token mean over the batch's chosen rows where the attention mask is 1, set
                        here on the answers' tokens (gptkit's SFT term is each chosen answer's token mean,
                        averaged over the pairs: the same when the chosen answers have one length, the case
                        compared whole); with answers of several lengths the odds-ratio term alone (TRL's
                        log_odds_ratio) is compared
  kto                   KTOTrainer._compute_loss (its precomputed-reference path, calculate_KL on), the
                        stand-in returning fixed per-token log-probs of 2P labelled rows and, for the
                        mismatched KL rows, others; the gradient is with respect to the rows' log-probs
                        (gptkit.training.objectives.kto: kto_loss, reference_point). Which completion each
                        mismatched row takes is data.unpaired's, not compared here: the previous row's, as
                        TRL's collator, but over the global micro-batch (all ranks) where TRL's is per device

This side computes the same with gptkit.training.objectives.dpo (dpo_loss, simpo_loss, orpo_loss,
answer_logps, answer_tokens) and prints the largest difference of each; it exits 1 when one differs by 1e-6
or more relative to max(1, |TRL's value|) (fp32 throughout: the logits' path sums log-probs in another order
than TRL's selective_log_softmax).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

P, T, V = 6, 12, 11
# (loss, beta, label_smoothing, gamma, lambda, chosen answers of one length)
CASES = [
    *((loss, beta, 0.0, 0.0, 0.0, False) for loss in ("sigmoid", "hinge", "ipo") for beta in (0.1, 0.5)),
    ("simpo", 2.0, 0.0, 0.5, 0.0, False),
    ("simpo", 2.5, 0.1, 1.4, 0.0, False),
    ("orpo", 0.0, 0.0, 0.0, 0.1, True),
    ("orpo", 0.0, 0.0, 0.0, 1.0, True),
    ("orpo", 0.0, 0.0, 0.0, 0.5, False),
]
# (beta, desirable_weight, undesirable_weight, the mismatched rows' mean log-ratio > 0 (else clamped to 0))
KTO_CASES = [(0.1, 1.0, 1.0, True), (0.5, 1.0, 1.33, True), (0.5, 1.0, 1.0, False)]


def inputs(same_chosen: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fixed rows of P pairs (chosen rows first, then rejected, as TRL batches them): ids [2P, T], labels
    [2P, T] (the ids on each answer, -100 on its prompt and padding: a prompt of 1..3 tokens, an answer of
    1..8; every chosen answer 5 tokens with same_chosen), the policy's per-token log-probs of the next token
    [2P, T - 1] (0 outside the answers), the reference's summed log-probs [2P] and logits [2P, T, V]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2 * P, T), generator=g)
    prompt = torch.randint(1, 4, (2 * P,), generator=g)
    answer = torch.randint(1, 9, (2 * P,), generator=g)
    if same_chosen:
        answer[:P] = 5
    pos = torch.arange(T)[None, :]
    on = (pos >= prompt[:, None]) & (pos < (prompt + answer)[:, None])  # [2P, T]
    labels = torch.where(on, ids, -100)
    mask = on[:, 1:].double()  # [2P, T - 1] the next token is the answer's
    logps = -torch.rand(2 * P, T - 1, generator=g, dtype=torch.float64) * 3 * mask
    ref = (logps.sum(-1) + (torch.rand(2 * P, generator=g, dtype=torch.float64) - 0.5) * 4).float()
    logits = torch.randn(2 * P, T, V, generator=g, dtype=torch.float64) * 2
    return dict(ids=ids, labels=labels, mask=mask, logps=logps, ref=ref, logits=logits)


def metrics() -> dict:
    from collections import defaultdict

    return {"train": defaultdict(list), "eval": defaultdict(list)}


def accelerator():
    def same(x, *a, **k):
        return x

    return SimpleNamespace(device=torch.device("cpu"), gather=same, gather_for_metrics=same, reduce=same)


def trl_dpo(loss_type: str, beta: float, data: dict) -> dict:
    from trl.trainer.dpo_trainer import DPOTrainer

    logps = data["logps"].clone().float().requires_grad_(True)
    mask = data["mask"].float()
    n = mask.shape[1]

    def model(**kwargs):
        return SimpleNamespace(
            log_probs=logps * mask,
            entropy=torch.zeros(2 * P, n),
            mean_logits=torch.zeros(2 * P, n),
            is_top1=torch.zeros(2 * P, n, dtype=torch.bool),
        )

    trainer = DPOTrainer.__new__(DPOTrainer)
    trainer.__dict__.update(
        model=SimpleNamespace(training=True),
        accelerator=accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _total_train_tokens=0,
        _tp_size=1,
        _metrics=metrics(),
    )
    completion = torch.cat([torch.zeros(2 * P, 1), mask], dim=1).long()  # [2P, T] unshifted
    ref_chosen, ref_rejected = data["ref"].chunk(2)
    batch = {
        "input_ids": data["ids"],
        "attention_mask": torch.ones_like(data["ids"]),
        "completion_mask": completion,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    loss = trainer._compute_loss(model, batch, return_outputs=False)
    loss.backward()
    m = trainer._metrics["train"]
    return {
        "loss": float(loss),
        "grad": logps.grad.tolist(),
        "chosen": m["rewards/chosen"][0],
        "margin": m["rewards/margins"][0],
    }


def trl_logits_side(loss_type: str, beta: float, smoothing: float, gamma: float, data: dict) -> dict:
    """CPOTrainer (simpo) or ORPOTrainer (orpo, beta = lambda) on fixed logits."""
    logits = data["logits"].clone().float().requires_grad_(True)
    labels = data["labels"]
    answer = (labels != -100).long()
    batch = {
        "concatenated_input_ids": data["ids"],
        # ORPO's NLL reads the ids where the mask is 1: the answers'; the stand-in model reads no mask
        "concatenated_attention_mask": answer,
        "concatenated_labels": labels,
    }
    common = dict(
        accelerator=accelerator(),
        is_encoder_decoder=False,
        aux_loss_enabled=False,
        beta=beta,
        padding_value=0,
        pad_token_id=0,
        concatenated_inputs=lambda *a, **k: batch,
    )

    def model(ids, attention_mask=None, use_cache=False, **kwargs):
        return SimpleNamespace(logits=logits)

    half = {"chosen_labels": labels[:P]}
    if loss_type == "simpo":
        from trl.experimental.cpo.cpo_trainer import CPOTrainer

        trainer = CPOTrainer.__new__(CPOTrainer)
        trainer.__dict__.update(
            common, loss_type="simpo", simpo_gamma=gamma, cpo_alpha=0.0, alpha=0.0, label_smoothing=smoothing
        )
        loss, m = trainer.get_batch_loss_metrics(model, half)
    else:
        from trl.experimental.orpo.orpo_trainer import ORPOTrainer

        trainer = ORPOTrainer.__new__(ORPOTrainer)
        trainer.__dict__.update(common)
        loss, m = trainer.get_batch_loss_metrics(model, half)
    loss.backward()
    return {
        "loss": float(loss),
        "grad": logits.grad.tolist(),
        "chosen": float(m["rewards/chosen"]),
        "margin": float(m["rewards/margins"]),
        "log_odds_ratio": float(m.get("log_odds_ratio", 0.0)),
    }


def kto_inputs(positive: bool) -> dict[str, torch.Tensor]:
    """inputs(False)'s 2P rows as unpaired rows (labels alternating), and the mismatched rows' per-token
    log-probs and the reference's sums of them (their mean log-ratio above 0 when positive)."""
    data = inputs(False)
    g = torch.Generator().manual_seed(1)
    mask = data["mask"]
    kl = -torch.rand(2 * P, T - 1, generator=g, dtype=torch.float64) * 3 * mask
    shift = 1.0 if positive else -1.0
    ref_kl = (kl.sum(-1) - shift + (torch.rand(2 * P, generator=g, dtype=torch.float64) - 0.5)).float()
    labels = torch.arange(2 * P) % 2 == 0
    labels[1] = True  # not half and half
    return {**data, "kl": kl, "ref_kl": ref_kl, "labels": labels}


def trl_kto(beta: float, wd: float, wu: float, positive: bool) -> dict:
    from trl.trainer.kto_trainer import KTOTrainer

    data = kto_inputs(positive)
    logps = data["logps"].clone().float().requires_grad_(True)
    mask = data["mask"].float()
    n = mask.shape[1]
    kl_ids = data["ids"].clone()

    def model(**kwargs):
        lp = data["kl"].float() * mask if kwargs["input_ids"] is kl_ids else logps * mask
        return SimpleNamespace(log_probs=lp, entropy=torch.zeros(2 * P, n), mean_logits=torch.zeros(2 * P, n))

    trainer = KTOTrainer.__new__(KTOTrainer)
    trainer.__dict__.update(
        model=SimpleNamespace(training=True),
        accelerator=accelerator(),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        calculate_KL=True,
        loss_type="kto",
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
        _total_train_tokens=0,
        _tp_size=1,
        _metrics=metrics(),
    )
    completion = torch.cat([torch.zeros(2 * P, 1), mask], dim=1).long()
    batch = {
        "input_ids": data["ids"],
        "attention_mask": torch.ones_like(data["ids"]),
        "completion_mask": completion,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": torch.ones_like(kl_ids),
        "KL_completion_mask": completion,
        "label": data["labels"],
        "ref_logps": data["ref"],
        "ref_KL_logps": data["ref_kl"],
    }
    loss = trainer._compute_loss(model, batch, return_outputs=False)
    loss.backward()
    m = trainer._metrics["train"]
    return {
        "loss": float(loss),
        "grad": logps.grad.tolist(),
        "chosen": m["rewards/chosen"][0],
        "rejected": m["rewards/rejected"][0],
        "kl": m["kl"][0],
    }


def trl_side() -> dict:
    import trl

    out = {"trl": trl.__version__, "cases": [], "kto": [trl_kto(*case) for case in KTO_CASES]}
    for loss, beta, smoothing, gamma, lam, same in CASES:
        data = inputs(same)
        if loss in ("sigmoid", "hinge", "ipo"):
            out["cases"].append(trl_dpo(loss, beta, data))
        else:
            out["cases"].append(
                trl_logits_side(loss, lam if loss == "orpo" else beta, smoothing, gamma, data)
            )
    return out


def rel(ours: float, theirs: float) -> float:
    """|ours - theirs| / max(1, |theirs|)."""
    return abs(ours - theirs) / max(1.0, abs(theirs))


def compare(trl: dict) -> int:

    from gptkit.training.objectives.dpo import answer_logps, answer_tokens, dpo_loss, orpo_loss, simpo_loss

    worst: dict[str, float] = {}
    for (loss, beta, smoothing, gamma, lam, same), want in zip(CASES, trl["cases"]):
        data = inputs(same)
        if loss in ("sigmoid", "hinge", "ipo"):
            leaf = data["logps"].clone().float().requires_grad_(True)
            mask = data["mask"].float()
            sums = (leaf * mask).sum(-1)  # [2P]
            counts = mask.sum(-1)
            ref = data["ref"]
            losses, chosen, rejected = dpo_loss(
                sums[:P], sums[P:], ref[:P], ref[P:], beta, 0.0, loss, counts[:P], counts[P:]
            )
            setting = f"beta {beta}"
        else:
            leaf = data["logits"].clone().float().requires_grad_(True)
            y = data["labels"][:, 1:]
            sums, counts = answer_logps(leaf[:, :-1], y), answer_tokens(y)
            if loss == "simpo":
                losses, chosen, rejected = simpo_loss(
                    sums[:P], sums[P:], counts[:P], counts[P:], beta, gamma, smoothing
                )
                setting = f"beta {beta} gamma {gamma} smoothing {smoothing}"
            else:
                losses, chosen, rejected = orpo_loss(sums[:P], sums[P:], counts[:P], counts[P:], lam)
                setting = f"lambda {lam}, chosen answers of {'one length' if same else 'several lengths'}"
        value = losses.mean()
        d_reward = max(
            rel(float(chosen.mean()), want["chosen"]), rel(float((chosen - rejected).mean()), want["margin"])
        )
        name = f"{loss:7s} {setting}"
        if loss == "orpo" and not same:
            # the odds-ratio term alone: mean over the pairs of log sigmoid(log odds ratio)
            avg = sums / counts
            term = -(losses.detach() + avg[:P].detach()) / lam  # the per-pair log sigmoid(log odds ratio)
            ours = float(term.mean())
            d = rel(ours, want["log_odds_ratio"])
            print(
                f"{name}: odds-ratio term {ours:+.8f} vs TRL {want['log_odds_ratio']:+.8f}  |d| {d:.1e} "
                f"rewards {d_reward:.1e}"
            )
            worst["odds-ratio term"] = max(worst.get("odds-ratio term", 0.0), d)
            worst["rewards"] = max(worst.get("rewards", 0.0), d_reward)
            continue
        value.backward()
        d_loss = rel(float(value.detach()), want["loss"])
        trl_grad = torch.tensor(want["grad"], dtype=torch.float64)
        d_grad = float((leaf.grad.double() - trl_grad).abs().max()) / max(1.0, float(trl_grad.abs().max()))
        print(
            f"{name}: loss {float(value.detach()):+.8f} vs TRL {want['loss']:+.8f}  |d| loss {d_loss:.1e} "
            f"grad {d_grad:.1e} rewards {d_reward:.1e} (relative)"
        )
        for k, v in (("loss", d_loss), ("grad", d_grad), ("rewards", d_reward)):
            worst[k] = max(worst.get(k, 0.0), v)
    from gptkit.training.objectives.kto import kto_loss, reference_point

    for (beta, wd, wu, positive), want in zip(KTO_CASES, trl["kto"]):
        data = kto_inputs(positive)
        leaf = data["logps"].clone().float().requires_grad_(True)
        mask = data["mask"].float()
        z0 = reference_point((data["kl"].float() * mask).sum(-1), data["ref_kl"])
        labels = data["labels"]
        losses, rewards = kto_loss((leaf * mask).sum(-1), data["ref"], labels, z0, beta, wd, wu)
        value = losses.mean()
        value.backward()
        d_loss = rel(float(value.detach()), want["loss"])
        trl_grad = torch.tensor(want["grad"], dtype=torch.float64)
        d_grad = float((leaf.grad.double() - trl_grad).abs().max()) / max(1.0, float(trl_grad.abs().max()))
        d_reward = max(
            rel(float(rewards[labels].mean()), want["chosen"]),
            rel(float(rewards[~labels].mean()), want["rejected"]),
        )
        d_kl = rel(float(z0), want["kl"])
        print(
            f"kto     beta {beta} weights {wd}/{wu} z0 {float(z0):.4f}: loss {float(value.detach()):+.8f} "
            f"vs TRL {want['loss']:+.8f}  |d| loss {d_loss:.1e} grad {d_grad:.1e} rewards {d_reward:.1e} "
            f"kl {d_kl:.1e}"
        )
        for k, v in (("loss", d_loss), ("grad", d_grad), ("rewards", d_reward), ("kl", d_kl)):
            worst[k] = max(worst.get(k, 0.0), v)
    print(
        f"TRL {trl['trl']}, torch {torch.__version__}: largest |difference| / max(1, |TRL's|) "
        + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    )
    return 0 if max(worst.values()) < 1e-6 else 1


if __name__ == "__main__":
    from trl_pair import main

    sys.exit(main(__file__, __doc__, trl_side, compare))
