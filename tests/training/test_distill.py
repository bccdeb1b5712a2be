"""objective=distill (gptkit/training/objectives/distill.py): the loss on fixed logits equals the formulas
written out here (float64) for forward KL, the generalized JSD and reverse KL at a temperature other than 1,
with its gradient; only the positions with a label count. Through the CLI: a tiny student distilled from a
tiny teacher trained here a few steps, the teacher frozen (weights unchanged, no gradient, no optimizer state,
not in the checkpoint); bad settings and a teacher of another vocabulary refused in one line, exit 2.
objective=gkd (on-policy): the tokens it trains on are the student's own keyed draws (not the teacher's, not
the data); its loss is the reverse KL over them written out plus alpha times the labels' CE; lmbda is the
share of on-policy micro-steps; a CLI run, and one stopped at step 2 and resumed with the weights and figures
of the straight run; on DDP and FSDP2 (long), the rows of one process. Both objectives under LoRA and QLoRA
with the student's adapters-off self as the teacher.
"""

import contextlib
import hashlib
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    HF_EOS,
    HF_TEXT,
    char_tokenizer,
    estimate_plan,
    make_run,
    rows_by_step,
    run_group,
    run_main,
)
from omegaconf import OmegaConf

from gptkit.training.objectives.distill import Distill, distill_loss

# ---- the formulas --------------------------------------------------------------------------------


def softmax(z, tau):
    """softmax(z / tau) over the last axis, written out."""
    e = torch.exp((z - z.max()) / tau)
    return e / e.sum()


def written_out(student, teacher, targets, beta, tau, alpha):
    """alpha CE + (1 - alpha) D, the mean over the label positions, position by position: D is
    sum_v t (log t - log s) at beta 0, sum_v s (log s - log t) at beta 1, else
    beta sum_v t log(t / m) + (1 - beta) sum_v s log(s / m) with m = beta t + (1 - beta) s."""
    total, n = student.new_zeros(()), 0
    for i in range(targets.shape[0]):
        for j in range(targets.shape[1]):
            if int(targets[i, j]) == -100:
                continue
            s, t = softmax(student[i, j], tau), softmax(teacher[i, j], tau)
            if beta == 0:
                d = (t * (t.log() - s.log())).sum()
            elif beta == 1:
                d = (s * (s.log() - t.log())).sum()
            else:
                m = beta * t + (1 - beta) * s
                d = beta * (t * (t / m).log()).sum() + (1 - beta) * (s * (s / m).log()).sum()
            ce = -softmax(student[i, j], 1.0)[targets[i, j]].log()
            total = total + alpha * ce + (1 - alpha) * d
            n += 1
    return total / n


def fixed():
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(2, 5, 7, generator=g, dtype=torch.float64) * 2).requires_grad_()
    teacher = torch.randn(2, 5, 7, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(0, 7, (2, 5), generator=g)
    # a padded row end and a prompt position: no label, nothing counted
    targets[0, 3:] = -100
    targets[1, 0] = -100
    return student, teacher, targets


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_the_loss_and_its_gradient_equal_the_formulas_on_fixed_logits(beta, alpha):
    student, teacher, targets = fixed()
    loss, ce, d = distill_loss(student, teacher, targets, beta, temperature=2.0, alpha=alpha)
    (grad,) = torch.autograd.grad(loss, student)
    want = written_out(student, teacher, targets, beta, 2.0, alpha)
    (want_grad,) = torch.autograd.grad(want, student)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(alpha * ce + (1 - alpha) * d, want.detach(), rtol=1e-12, atol=1e-12)
    # a position without a label has no gradient; every labelled one has
    unlabelled = targets == -100
    assert grad[unlabelled].abs().max() == 0 and (grad[~unlabelled].abs().sum(-1) > 0).all()
    # the same teacher and student: no divergence
    same = distill_loss(teacher, teacher, targets, beta, 2.0, 0.0)[0]
    assert abs(float(same)) < 1e-12


def test_the_forward_kl_gradient_is_the_closed_form():
    """d/dz KL(t || s) at temperature tau, per labelled position: (s - t) / tau, over the label count."""
    student, teacher, targets = fixed()
    tau = 2.0
    loss = distill_loss(student, teacher, targets, 0.0, tau, 0.0)[0]
    (grad,) = torch.autograd.grad(loss, student)
    mask = targets != -100
    closed = (torch.softmax(student.detach() / tau, -1) - torch.softmax(teacher / tau, -1)) / tau
    torch.testing.assert_close(grad[mask], closed[mask] / int(mask.sum()), rtol=1e-10, atol=1e-12)


def test_a_batch_without_labels_is_zero_not_nan():
    student, teacher, targets = fixed()
    loss = distill_loss(student, teacher, torch.full_like(targets, -100), 0.5, 1.0, 0.5)[0]
    assert float(loss.detach()) == 0.0 and loss.requires_grad


# ---- the chunked path objective=distill trains with ------------------------------------------------


def worst(got, want):
    """The largest |got - want| / max(1, |want|) over tensors."""
    return max(float(((g - w).abs() / w.abs().clamp(min=1)).max().detach()) for g, w in zip(got, want))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_the_chunked_loss_and_gradients_equal_the_unchunked_reference(beta, tau, monkeypatch):
    """chunked_distill_loss (both models' hidden states and heads, chunk by chunk over the label positions:
    what objective=distill trains with) against distill_loss on the whole logits, fp32, to 1e-6: the loss, CE,
    D and the gradient of every student parameter (its blocks through the hidden states, its head). Heads
    tied and untied, soft-capped (model.logit_softcap, another cap for the teacher) and not, a teacher of
    its own width, and the policy itself with its adapters off (the weight read inside its forward); labels
    masked on a row end and a prompt; chunks of 3 label rows."""
    from gptkit.model import GPT, ModelConfig
    from gptkit.training.objectives.base import FrozenModel, evaluating
    from gptkit.training.objectives.distill import chunked_distill_loss
    from gptkit_kernels import linear_ce

    V = 61
    monkeypatch.setattr(linear_ce, "CHUNK_LOGITS", 12 * V)

    def gpt(d_model, tied, softcap, seed):
        torch.manual_seed(seed)
        cfg = dict(n_layers=1, n_heads=2, max_seq_len=16, init_std=0.3)
        return GPT(
            ModelConfig(vocab_size=V, d_model=d_model, tie_embeddings=tied, logit_softcap=softcap, **cfg)
        )

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (2, 11), generator=g)
    y = torch.randint(0, V, (2, 11), generator=g)
    y[0, 8:] = -100
    y[1, :2] = -100
    cases = {
        "tied": (gpt(32, True, None, 0), FrozenModel(gpt(48, True, None, 1), name="teacher")),
        "untied, capped": (gpt(32, False, 3.0, 0), FrozenModel(gpt(48, False, 5.0, 1), name="teacher")),
        "self, adapters off": (gpt(32, False, 4.0, 2), None),
    }
    for name, (student, teacher) in cases.items():
        if teacher is None:
            teacher = FrozenModel(None, lambda policy: contextlib.nullcontext(), name="teacher")
        params = list(student.parameters())
        got = chunked_distill_loss(student, teacher, x, y, beta, tau, alpha=0.3)
        got_grads = torch.autograd.grad(got[0], params)
        with evaluating(teacher.module or student):
            teacher_logits = (teacher.module or student)(x).logits
        want = distill_loss(student(x).logits, teacher_logits, y, beta, tau, alpha=0.3)
        want_grads = torch.autograd.grad(want[0], params)
        assert got[0].dtype == torch.float32 and not got[1].requires_grad and not got[2].requires_grad
        assert worst(got, want) <= 1e-6, (name, got, want)
        assert worst(got_grads, want_grads) <= 1e-6, name
        assert float(got[2]) > (0 if teacher.module is not None else -1e-6)
        # objective=distill's step trains with it: the same loss, and no forward of the student (nor of a
        # teacher of its own) gives whole logits
        outputs = []
        hooks = [
            m.register_forward_hook(lambda m, i, out: outputs.append(out))
            for m in (student, teacher.module)
            if m
        ]
        plan = SimpleNamespace(
            cfg=OmegaConf.create({"distill": {"beta": beta, "temperature": tau, "alpha": 0.3}})
        )
        step, n = Distill(plan, {"teacher": teacher}).loss(student, (x, y))
        for h in hooks:
            h.remove()
        assert worst([step], [want[0]]) <= 1e-6 and int(n) == int((y != -100).sum())
        assert outputs and all(out.logits is None for out in outputs)
    # no label at all: 0 with a gradient path, as distill_loss
    none = chunked_distill_loss(student, teacher, x, torch.full_like(y, -100), beta, tau, alpha=0.3)[0]
    assert float(none.detach()) == 0.0 and none.requires_grad


def written_topk(student, teacher, targets, k, tau):
    """D_k of distill_topk.py written out position by position (float64): the teacher's top-k (of its
    log-probs at temperature 1) renormalized at temperature tau, against the student's whole softmax."""
    total, n = student.new_zeros(()), 0
    for i in range(targets.shape[0]):
        for j in range(targets.shape[1]):
            if int(targets[i, j]) == -100:
                continue
            logt = torch.log_softmax(teacher[i, j], -1)
            top = logt.topk(k)
            tk = softmax(top.values, tau)
            s = softmax(student[i, j], tau)
            total = total + (tk * (tk.log() - s[top.indices].log())).sum()
            n += 1
    return total / n


def test_the_top_k_loss_is_the_forward_kl_to_the_renormalized_top_k_and_the_full_one_at_k_v():
    """distill.teacher=precomputed's loss (distill_topk.py) on fixed logits: k = V is distill_loss's forward
    KL (value and gradient); k = 3 is the written-out D_k, above 0, and not the full forward KL."""
    from gptkit.training.objectives.distill_topk import topk_distill_loss

    student, teacher, targets = fixed()
    logt = torch.log_softmax(teacher, -1)
    for k in (7, 3):
        top = logt.topk(k, dim=-1)
        loss, ce, d = topk_distill_loss(student, top.indices, top.values, targets, 2.0, alpha=0.3)
        (grad,) = torch.autograd.grad(loss, student)
        if k == 7:
            want = distill_loss(student, teacher, targets, 0.0, 2.0, 0.3)[0]
        else:
            # alpha CE (the written-out loss at alpha 1) + (1 - alpha) D_k
            ce_grad = written_out(student, teacher, targets, 0.0, 2.0, 1.0)
            want = 0.3 * ce_grad + 0.7 * written_topk(student, teacher, targets, 3, 2.0)
            assert (
                float(d) > 0
                and abs(float(d) - float(distill_loss(student, teacher, targets, 0.0, 2.0)[2])) > 1e-3
            )
        (want_grad,) = torch.autograd.grad(want, student)
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
        assert grad[targets == -100].abs().max() == 0


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_the_chunked_top_k_loss_and_gradients_equal_the_unchunked_reference(tau, monkeypatch):
    """chunked_topk_distill_loss (the student's hidden states and head, chunk by chunk over the label
    positions: what distill.teacher=precomputed trains with) against topk_distill_loss on the whole logits,
    fp32, to 1e-6: the loss, CE, D_k and every parameter's gradient; heads tied and untied soft-capped; labels
    masked on a row end and a prompt; chunks of 3 label rows; the objective's step holds no whole logits."""
    from gptkit.model import GPT, ModelConfig
    from gptkit.training.objectives.distill_topk import chunked_topk_distill_loss, topk_distill_loss
    from gptkit_kernels import linear_ce

    V, k = 61, 5
    monkeypatch.setattr(linear_ce, "CHUNK_LOGITS", 12 * V)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (2, 11), generator=g)
    y = torch.randint(0, V, (2, 11), generator=g)
    y[0, 8:] = -100
    y[1, :2] = -100
    top = torch.log_softmax(3 * torch.randn(2, 11, V, generator=g), -1).topk(k, dim=-1)
    ids, logps = top.indices, top.values
    for tied, softcap in ((True, None), (False, 3.0)):
        torch.manual_seed(0)
        cfg = dict(n_layers=1, n_heads=2, max_seq_len=16, init_std=0.3, tie_embeddings=tied)
        student = GPT(ModelConfig(vocab_size=V, d_model=32, logit_softcap=softcap, **cfg))
        params = list(student.parameters())
        got = chunked_topk_distill_loss(student, x, ids, logps, y, tau, alpha=0.3)
        got_grads = torch.autograd.grad(got[0], params)
        want = topk_distill_loss(student(x).logits, ids, logps, y, tau, alpha=0.3)
        want_grads = torch.autograd.grad(want[0], params)
        assert got[0].dtype == torch.float32 and not got[1].requires_grad and float(got[2]) > 0
        assert worst(got, want) <= 1e-6, (tied, got, want)
        assert worst(got_grads, want_grads) <= 1e-6, tied
        outputs = []
        hook = student.register_forward_hook(lambda m, i, out: outputs.append(out))
        plan = SimpleNamespace(
            cfg=OmegaConf.create({"distill": {"teacher": "precomputed", "temperature": tau, "alpha": 0.3}})
        )
        step, n = Distill(plan, {}).loss(student, (x, y, ids, logps))
        hook.remove()
        assert worst([step], [want[0]]) <= 1e-6 and int(n) == int((y != -100).sum())
        assert outputs and all(out.logits is None for out in outputs)


def test_a_precomputed_teacher_holds_no_teacher_and_reads_the_forward_kl_only():
    from gptkit.errors import ConfigError
    from gptkit.training.objectives.distill import check_distill_config

    group = {"teacher": "precomputed", "beta": 0.0}
    assert Distill.frozen_models(group) == () and Distill.precomputed_models(group) == ("teacher",)
    assert Distill.frozen_models({}) == ("teacher",) and Distill.precomputed_models({}) == ()
    for bad, message in [
        ({"teacher": "precomputed", "beta": 0.5}, "distill.teacher=precomputed keeps the teacher's top-k"),
        ({"teacher": "cached"}, "distill.teacher='cached' is not one of live, precomputed"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_distill_config(bad)


# ---- the CLI ---------------------------------------------------------------------------------------
def tiny(root, name, layers, d_model, *extra):
    """A byte-tokenizer run of `layers` x `d_model` on the text, 4 steps (no validation before the end)."""
    return [
        "model=llama-tiny",
        "tokenizer=byte",
        f"model.n_layers={layers}",
        f"model.d_model={d_model}",
        f"model.d_ff={2 * d_model}",
        "model.max_seq_len=32",
        "data=files",
        f"data.paths=[{root / 'text.txt'}]",
        "trainer.batch_size=2",
        "trainer.max_steps=4",
        "trainer.val_every=4",
        "trainer.val_windows=2",
        "trainer.log_every=2",
        "trainer.progress=off",
        "trainer.accelerator=cpu",
        "trainer.threads=1",
        f"runs_dir={root / 'runs'}",
        f"name={name}",
        *extra,
    ]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from gptkit.cli import main

    root = tmp_path_factory.mktemp("distill")
    (root / "text.txt").write_text((HF_TEXT.lower() + ". ") * 100)
    assert main(["train", *tiny(root, "teacher", 2, 64)]) == 0
    return root


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_student_distills_from_a_teacher_run_which_stays_frozen(teacher, capsys, monkeypatch):
    from gptkit.runs import load_model
    from gptkit.training.metrics_csv import read_rows

    made = []
    init = Distill.__init__

    def keep(self, plan, frozen=None):
        init(self, plan, frozen)
        made.append(self)

    monkeypatch.setattr(Distill, "__init__", keep)
    ckpt = teacher / "runs" / "teacher" / "checkpoints" / "last.ckpt"
    before = sha(ckpt)
    code, out, err = run_main(
        capsys,
        "train",
        *tiny(teacher, "student", 1, 32, "objective=distill", f"teacher={teacher / 'runs' / 'teacher'}"),
        "distill.beta=0.5",
        "distill.temperature=2.0",
        "distill.alpha=0.5",
    )
    assert code == 0, err
    assert "distill: generalized JSD beta 0.5, temperature 2, alpha 0.5" in out + err
    assert "teacher: frozen" in out + err and "(2 layers, d_model 64)" in out + err
    # the teacher: another size, frozen, and after 4 steps exactly the weights of its run
    (objective,) = made
    frozen = objective.teacher.module
    assert (frozen.cfg.n_layers, frozen.cfg.d_model) == (2, 64)
    assert not frozen.training and all(not p.requires_grad and p.grad is None for p in frozen.parameters())
    *_, direct = load_model(teacher / "runs" / "teacher")
    for (k, a), b in zip(frozen.state_dict().items(), direct.state_dict().values()):
        assert torch.equal(a, b), k
    assert sha(ckpt) == before
    # the student's checkpoint: its own weights and optimizer state only, the teacher's source recorded
    run = teacher / "runs" / "student"
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    *_, student = load_model(run)
    assert student.cfg.n_layers == 1 and set(saved["state_dict"]) == {
        f"model.{k}" for k in student.state_dict()
    }
    n_opt = sum(len(g["params"]) for g in saved["optimizer_states"][0]["param_groups"])
    assert n_opt == len(list(student.parameters()))
    assert saved["gptkit_frozen_teacher"] == {"path": str(ckpt), "step": 4}
    # the train rows carry the two parts; val/loss is the labels' cross-entropy
    _, rows = read_rows(run / "metrics.csv")
    rows = list(rows.values())
    logged = [r for r in rows if r.get("train/distill/divergence") not in (None, "")]
    assert logged and all(float(r["train/distill/divergence"]) > 0 for r in logged)
    assert any(r.get("val/loss") not in (None, "") for r in rows)


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "objective=distill needs frozen.teacher=<"),
        (["frozen.teacher=start"], "frozen.teacher=start is the starting weights, and without init_from="),
        (["distill.beta=1.5"], "distill.beta=1.5 must be in [0, 1]"),
        (["distill.temperature=0"], "distill.temperature=0 must be > 0"),
        (["distill.alpha=-0.1"], "distill.alpha=-0.1 must be in [0, 1]"),
        (["frozen.teacher={root}/nowhere"], "frozen.teacher={root}/nowhere: {root}/nowhere does not exist"),
        (["objective=gkd", "gkd.lmbda=2"], "gkd.lmbda=2 must be in [0, 1]"),
        (["objective=gkd", "gkd.beta=-1"], "gkd.beta=-1 must be in [0, 1]"),
        (["objective=gkd", "gkd.prompt_len=0"], "gkd.prompt_len=0 must be a positive integer"),
        (["objective=gkd", "gkd.max_new_tokens=1.5"], "gkd.max_new_tokens=1.5 must be a positive integer"),
        (["objective=gkd", "gkd.prompt_len=32"], "gkd.prompt_len=32 leaves no room to sample in rows of 32"),
        (
            ["objective=gkd", "data.pack=documents"],
            "objective=gkd continues the start of each row as one text",
        ),
    ],
)
def test_bad_distill_commands_exit_2_with_one_line_before_anything_is_written(
    teacher, tmp_path, capsys, args, message
):
    args = [a.format(root=tmp_path) for a in args]
    if not any(a.startswith("frozen.teacher=") for a in args) and "needs" not in message:
        args.append(f"frozen.teacher={teacher / 'runs' / 'teacher'}")
    # objective=distill unless the case names another (gkd)
    objective = next((a for a in args if a.startswith("objective=")), "objective=distill")
    args = [a for a in args if not a.startswith("objective=")]
    code, _, err = run_main(capsys, "train", *tiny(tmp_path, "bad", 1, 32, objective, *args))
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith(f"error: {message.format(root=tmp_path)}"), err
    assert not (tmp_path / "runs" / "bad").exists()


@pytest.mark.parametrize(
    "objective, finetune, source",
    [
        ("distill", "lora", "start"),
        ("distill", "qlora", "start"),
        ("gkd", "lora", "start"),
        ("gkd", "qlora", "start"),
        ("gkd", "lora", "run"),
    ],
)
def test_lora_distills_from_the_start_its_adapters_off_which_it_equals_at_step_1(
    teacher, capsys, objective, finetune, source
):
    """finetune=lora (qlora: on the NF4 base) with frozen.teacher=start, objective=distill and objective=gkd
    (every step on-policy: the student samples through its adapters): the teacher is the student with its
    adapters off (no second copy; the chunked loss reads the policy's own head), at step 1 the adapters' B is
    0, so the divergence is exactly 0, then it grows. source run: the teacher is the run the adapters start
    from, held as a model of its own (its own head), the same at step 1."""
    run = teacher / "runs" / "teacher"
    gkd = ("gkd.prompt_len=8", "gkd.max_new_tokens=8", "gkd.lmbda=1.0") if objective == "gkd" else ()
    name = f"{objective[0]}-{finetune}-{source}"
    frozen = "teacher=start" if source == "start" else f"teacher={run}"
    args = tiny(teacher, name, 2, 64, f"objective={objective}", *gkd, frozen, f"init_from={run}")
    # the start's model and tokenizer
    args = [a for a in args if not a.startswith(("model", "tokenizer"))]
    nf4 = ("qlora.block_size=32", "qlora.scaler_block_size=8") if finetune == "qlora" else ()
    lora = (
        f"finetune={finetune}",
        *nf4,
        "lora.rank=4",
        "lora.targets=[q,v]",
        "trainer.log_every=1",
        "trainer.max_steps=2",
    )
    code, out, err = run_main(capsys, "train", *args, *lora, f"{objective}.beta=0.5", "optim.lr=1e-2")
    assert code == 0, err
    rows = rows_by_step(teacher / "runs" / name)
    if objective == "gkd":
        assert [float(rows[s]["train/distill/on_policy"]) for s in (1, 2)] == [1.0, 1.0]
    assert float(rows[1]["train/distill/divergence"]) == 0.0
    assert float(rows[2]["train/distill/divergence"]) > 0, rows[2]


def test_a_reward_model_as_the_teacher_is_refused_in_one_line(teacher, tmp_path, capsys):
    """A reward model (model.score_head) has an LM head it never trained: no teacher, one line, exit 2, before
    anything is written."""
    (tmp_path / "rm").mkdir()
    rm, _, _ = make_run(tmp_path / "rm", score_head=True)
    code, _, err = run_main(
        capsys, "train", *tiny(teacher, "bad-rm", 1, 32, "objective=distill", f"teacher={rm}")
    )
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        f"error: frozen.teacher={rm} is a reward model"
    )
    assert not (teacher / "runs" / "bad-rm" / "checkpoints").exists()


def test_a_teacher_of_another_tokenizer_or_vocabulary_size_is_refused_in_one_line(teacher, capsys):
    run = teacher / "runs" / "teacher"
    base = tiny(teacher, "bad-vocab", 1, 32, "objective=distill", f"teacher={run}")
    # another tokenizer: every token must sit at the same id
    char_tokenizer().save(str(teacher / "chars.json"))
    chars = ["tokenizer=file", f"tokenizer.path={teacher / 'chars.json'}", f"tokenizer.eos_token='{HF_EOS}'"]
    code, _, err = run_main(capsys, "train", *base, *chars)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(
        f"error: frozen.teacher={run} has another vocabulary than the policy"
    )
    assert "256 tokens in" in last and "31 in" in last
    # objective=gkd reads its teacher through the same check
    gkd = tiny(teacher, "bad-vocab", 1, 32, "objective=gkd", f"teacher={run}", "gkd.prompt_len=8")
    code, _, err = run_main(capsys, "train", *gkd, *chars)
    assert code == 2 and err.strip().splitlines()[-1] == last
    # the same tokenizer, padded to another model.vocab_size
    code, _, err = run_main(capsys, "train", *base, "vocab_multiple=100")
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: frozen.teacher={run} has model.vocab_size 256, the policy")
    assert "their logits must line up" in last
    assert not (teacher / "runs" / "bad-vocab" / "checkpoints").exists()


def test_the_memory_estimate_counts_chunks_of_logits_not_whole_ones():
    """objective=distill's loss reads both heads chunk by chunk: the estimate counts chunks (bench kernels'
    distill-memory row measures the chunked loss below that count), not the LM loss's 3 whole fp32 copies."""
    from gptkit.model import ModelConfig
    from gptkit.training.memory import chunked_logits_bytes, estimate

    cfg = ModelConfig(vocab_size=150_000, max_seq_len=4096, n_layers=1, n_heads=2, d_model=32)
    plan = estimate_plan(cfg, objective="distill")
    plan.batch_size, plan.seq_len = 1, 4096
    assert estimate(plan)["logits"] == chunked_logits_bytes(4096, cfg) < 2 * (1 << 28) + 2**20
    plan.objective = "lm"
    assert estimate(plan)["logits"] == 3 * 4096 * 150_000 * 4


def test_distill_flops_count_the_teachers_forward():
    class Counts:
        forward_dense, forward_causal = 2.0, 1.5

    assert Distill.flops(Counts(), 6.0, 4.5) == (8.0, 6.0)


# ---- objective=gkd: on-policy distillation ------------------------------------------------------------
def gkd_objective(lmbda=1.0, alpha=0.3, beta=1.0, temperature=2.0, seed=3):
    """objective=gkd on two tiny random GPTs of one vocabulary (the teacher wider), rows of 12 tokens."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from gptkit.model import GPT, ModelConfig
    from gptkit.training.objectives.base import FrozenModel
    from gptkit.training.objectives.gkd import GKD

    def gpt(d_model, seed):
        torch.manual_seed(seed)
        cfg = ModelConfig(vocab_size=40, max_seq_len=16, n_layers=1, n_heads=2, d_model=d_model)
        model = GPT(cfg)
        with torch.no_grad():
            # sharp, unlike distributions: the two models' draws with one key differ
            for p in model.parameters():
                p.add_(0.5 * torch.randn_like(p))
        return model

    settings = dict(lmbda=lmbda, alpha=alpha, beta=beta, temperature=temperature, prompt_len=5)
    plan = SimpleNamespace(cfg=OmegaConf.create({"gkd": settings, "seed": seed}), seq_len=12)
    student, teacher = gpt(16, 0), gpt(32, 1)
    objective = GKD(plan, {"teacher": FrozenModel(teacher, name="teacher")})
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 40, (2, 13), generator=g)
    return objective, student, teacher, (rows[:, :-1], rows[:, 1:])


def test_gkd_samples_the_students_own_continuations_of_each_rows_start():
    from gptkit.inference.rollouts import RolloutOptions, sample_groups, sample_key

    objective, student, teacher, (x, _) = gkd_objective()
    xs, ys = objective.sample(student, x, step=7)
    assert xs.shape == (2, 11) and torch.equal(xs[:, :5], x[:, :5])
    completions = [row[row != -100].tolist() for row in ys]
    assert [len(c) for c in completions] == [7, 7] and torch.equal(xs[:, 5:], ys[:, 4:-1])
    # each row: the student's own draw with its key (seed, micro-step, row, 0), as GRPO's sampler draws it
    opts = RolloutOptions(7, temperature=2.0)
    for b in range(2):
        key = [[sample_key(3, 7, b, 0)]]
        (mine,) = sample_groups(student, [x[b, :5].tolist()], key, opts, [7])
        (theirs,) = sample_groups(teacher, [x[b, :5].tolist()], key, opts, [7])
        assert completions[b] == mine[0].tokens != theirs[0].tokens
        assert completions[b] != x[b, 5:12].tolist()
    # another micro-step draws other tokens; the same one the same (a resume)
    assert torch.equal(objective.sample(student, x, step=7)[1], ys)
    assert not torch.equal(objective.sample(student, x, step=8)[1], ys)


def test_the_gkd_loss_is_the_reverse_kl_over_the_sampled_tokens_plus_the_label_term_written_out():
    objective, student, teacher, (x, y) = gkd_objective(alpha=0.3, temperature=2.0)
    xs, ys = objective.sample(student, x, step=0)
    loss, n = objective.loss(student, (x, y))
    assert int(n) == y.numel() and objective.micro == 1
    with torch.no_grad():
        s, t = student(xs).logits.double(), teacher(xs).logits.double()
        labels = student(x).logits.double()
    # sum_v s (log s - log t) at temperature 2, the mean over the 2 x 7 sampled positions only
    d = written_out(s, t, ys, 1.0, 2.0, 0.0)
    ce = written_out(labels, labels, y, 1.0, 1.0, 1.0)
    torch.testing.assert_close(loss.double(), 0.3 * ce + 0.7 * d, rtol=1e-5, atol=1e-6)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None for p in student.parameters())
    # lmbda 0: objective=distill's step on the row itself (beta, temperature and alpha gkd's)
    offline, *_ = gkd_objective(lmbda=0.0)
    with torch.no_grad():
        want = distill_loss(student(x).logits, teacher(x).logits, y, 1.0, 2.0, 0.3)[0]
        torch.testing.assert_close(offline.loss(student, (x, y))[0], want)


def test_gkd_lmbda_is_the_share_of_on_policy_micro_steps_drawn_by_key():
    from gptkit.training.objectives.gkd import on_policy

    for lmbda in (0.0, 0.25, 1.0):
        share = sum(on_policy(1, m, lmbda) for m in range(4000)) / 4000
        assert abs(share - lmbda) < 0.03
    assert [on_policy(1, m, 0.5) for m in range(50)] == [on_policy(1, m, 0.5) for m in range(50)]


GKD_ARGS = ["objective=gkd", "gkd.prompt_len=8", "gkd.max_new_tokens=12", "gkd.lmbda=0.7"]


@pytest.fixture(scope="module")
def gkd_straight(teacher):
    """A student trained 4 steps by objective=gkd from the teacher run, through the CLI: its folder."""
    from gptkit.cli import main

    source = teacher / "runs" / "teacher"
    args = tiny(teacher, "gkd-straight", 1, 32, *GKD_ARGS, f"teacher={source}")
    assert main(["train", *args]) == 0
    return teacher / "runs" / "gkd-straight"


def test_gkd_through_the_cli_samples_and_logs_its_share_with_val_loss_on_the_labels(gkd_straight):
    rows = rows_by_step(gkd_straight)
    logged = [r for r in rows.values() if r.get("train/distill/on_policy") not in (None, "")]
    assert logged and all(float(r["train/distill/divergence"]) > 0 for r in logged)
    # lmbda 0.7: each log step's share of on-policy micro-steps is the keyed draws' (seed, micro-step)
    from omegaconf import OmegaConf

    from gptkit.training.objectives.gkd import on_policy

    seed = int(OmegaConf.load(gkd_straight / "config.yaml").seed)
    drawn = [on_policy(seed, m, 0.7) for m in range(4)]
    assert [float(r["train/distill/on_policy"]) for r in logged] == [sum(drawn[:2]) / 2, sum(drawn[2:]) / 2]
    assert any(drawn)
    assert rows[4]["val/loss"] and float(rows[4]["val/loss"]) > 0
    saved = torch.load(gkd_straight / "checkpoints" / "last.ckpt", weights_only=True)
    assert "gptkit_frozen_teacher" in saved and all("teacher" not in k for k in saved["state_dict"])


def test_gkd_stopped_and_resumed_ends_with_the_weights_and_figures_of_an_uninterrupted_run(
    teacher, gkd_straight, capsys
):
    from gptkit.runs import load_model

    source = teacher / "runs" / "teacher"
    args = tiny(teacher, "gkd-resumed", 1, 32, *GKD_ARGS, f"teacher={source}", "trainer.stop_at_step=2")
    code, _, err = run_main(capsys, "train", *args)
    assert code == 0, err
    stopped = torch.load(teacher / "runs" / "gkd-resumed" / "checkpoints" / "last.ckpt", weights_only=True)
    assert stopped["global_step"] == 2
    code, _, err = run_main(capsys, "train", f"resume={teacher / 'runs' / 'gkd-resumed'}")
    assert code == 0, err
    *_, straight = load_model(gkd_straight)
    *_, resumed = load_model(teacher / "runs" / "gkd-resumed")
    for (k, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k
    # every step's figures, the same (the resumed run's rows: step 1-2 before the stop, 3-4 after; the stopped
    # run validated at its step 2 as well), the final val loss too
    keys = ("train/loss", "train/distill/ce", "train/distill/divergence", "train/distill/on_policy")
    want, got = rows_by_step(gkd_straight), rows_by_step(teacher / "runs" / "gkd-resumed")
    assert {s: [r.get(k) for k in keys] for s, r in want.items()} == {
        s: [r.get(k) for k in keys] for s, r in got.items()
    }
    assert want[4]["val/loss"] and want[4]["val/loss"] == got[4]["val/loss"]


@pytest.mark.long
def test_distill_resumes_bit_exactly_and_on_2_processes_equals_one_process(teacher, capsys):
    """4 steps of 2 windows: stopped at step 2 and resumed (the teacher read again from its source), the same
    floats; DDP and FSDP2 (fp32) on 2 CPU ranks of 1 window each log what one process logs, each rank's
    teacher the same frozen run."""
    run = teacher / "runs" / "teacher"
    keys = ("train/loss", "train/distill/divergence", "train/distill/ce", "val/loss")

    def args(name, *extra):
        base = tiny(teacher, name, 1, 32, "objective=distill", f"teacher={run}", "model.dropout=0.0")
        return [*base, "distill.beta=0.5", "distill.alpha=0.5", "trainer.log_every=1", *extra]

    def rows(name):
        got = rows_by_step(teacher / "runs" / name)
        return {s: [r.get(k) for k in keys] for s, r in got.items()}

    code, _, err = run_main(capsys, "train", *args("d-one"))
    assert code == 0, err
    one = rows("d-one")
    assert all(one[s][0] for s in (1, 2, 3, 4)) and one[4][3], one
    code, _, err = run_main(capsys, "train", *args("d-split", "trainer.stop_at_step=2"))
    assert code == 0, err
    code, _, err = run_main(
        capsys, "train", f"resume={teacher / 'runs' / 'd-split'}", "trainer.progress=off", "trainer.threads=1"
    )
    assert code == 0, err
    # (the stop at step 2 validates there too)
    assert {s: r[:3] for s, r in rows("d-split").items()} == {s: r[:3] for s, r in one.items()}
    assert rows("d-split")[4] == one[4]
    for name, extra in (
        ("d-ddp", ["trainer=ddp"]),
        ("d-fsdp", ["trainer=fsdp", "trainer.precision=32-true"]),
    ):
        r = run_group(
            "-m", "gptkit", "train", *args(name, *extra, "trainer.devices=2", "trainer.batch_size=1")
        )
        assert r.returncode == 0, r.stderr[-3000:]
        two = rows(name)
        for step, row in one.items():
            for k, want, got in zip(keys, row, two[step]):
                if want:
                    assert float(got) == pytest.approx(float(want), abs=1e-5), (name, step, k)


@pytest.mark.long
def test_gkd_on_ddp_and_fsdp2_equals_one_process(teacher):
    """objective=gkd on 2 CPU ranks of 2 rows each (DDP, and FSDP2 in fp32) logs what one process of 4 rows
    logs, step by step: row b of rank r samples with the key of its place r * 2 + b in the step's global batch
    (the window sampler's slice), so the 2 ranks draw the completions one process draws."""
    source = teacher / "runs" / "teacher"
    keys = (
        "train/loss",
        "train/distill/divergence",
        "train/distill/ce",
        "train/distill/on_policy",
        "val/loss",
    )

    def args(name, *extra):
        base = tiny(teacher, name, 1, 32, *GKD_ARGS, f"teacher={source}", "model.dropout=0.0")
        # seed 0, lmbda 0.6: micro-steps 0 and 3 on-policy, 1 and 2 not (on_policy's keyed draws)
        tail = ["seed=0", "gkd.lmbda=0.6", "gkd.alpha=0.5", "trainer.log_every=1", *extra]
        return ["-m", "gptkit", "train", *base, *tail]

    def rows(name):
        got = rows_by_step(teacher / "runs" / name)
        return {s: [r.get(k) for k in keys] for s, r in got.items()}

    r = run_group(*args("gkd-one", "trainer.batch_size=4"))
    assert r.returncode == 0, r.stderr[-3000:]
    one = rows("gkd-one")
    assert all(one[s][0] for s in (1, 2, 3, 4)) and one[4][4], one
    assert [one[s][3] for s in (1, 2, 3, 4)] == ["1.0", "0.0", "0.0", "1.0"], one
    for name, extra in (
        ("gkd-ddp", ["trainer=ddp"]),
        ("gkd-fsdp", ["trainer=fsdp", "trainer.precision=32-true"]),
    ):
        r = run_group(*args(name, *extra, "trainer.devices=2", "trainer.batch_size=2"))
        assert r.returncode == 0, r.stderr[-3000:]
        two = rows(name)
        for step, row in one.items():
            for k, want, got in zip(keys, row, two[step]):
                if want:
                    # the divergence (about 0.02 here) to 1e-6: other samples move it by more
                    tol = 1e-6 if k == "train/distill/divergence" else 1e-5
                    assert float(got) == pytest.approx(float(want), abs=tol), (name, step, k)
