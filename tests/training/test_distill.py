"""objective=distill (gptkit/training/objectives/distill.py): the loss on fixed logits equals the formulas
written out here (float64) for forward KL, the generalized JSD and reverse KL at a temperature other than 1,
with its gradient; only the positions with a label count. Through the CLI: a tiny student distilled from a
tiny teacher trained here a few steps, the teacher frozen (weights unchanged, no gradient, no optimizer state,
not in the checkpoint); bad settings and a teacher of another vocabulary refused in one line, exit 2.
"""

import contextlib
import hashlib
from types import SimpleNamespace

import pytest
import torch
from conftest import HF_EOS, HF_TEXT, char_tokenizer, estimate_plan, run_main
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
    ],
)
def test_bad_distill_commands_exit_2_with_one_line_before_anything_is_written(
    teacher, tmp_path, capsys, args, message
):
    args = [a.format(root=tmp_path) for a in args]
    if not any(a.startswith("frozen.teacher=") for a in args) and "needs" not in message:
        args.append(f"frozen.teacher={teacher / 'runs' / 'teacher'}")
    code, _, err = run_main(capsys, "train", *tiny(tmp_path, "bad", 1, 32, "objective=distill", *args))
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith(f"error: {message.format(root=tmp_path)}"), err
    assert not (tmp_path / "runs" / "bad").exists()


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
