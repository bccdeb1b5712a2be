"""objective=distill (gptkit/training/objectives/distill.py): the loss on fixed logits equals the formulas
written out here (float64) for forward KL, the generalized JSD and reverse KL at a temperature other than 1,
with its gradient; only the positions with a label count. Through the CLI: a tiny student distilled from a
tiny teacher trained here a few steps, the teacher frozen (weights unchanged, no gradient, no optimizer state,
not in the checkpoint); bad settings and a teacher of another vocabulary refused in one line, exit 2.
"""

import hashlib

import pytest
import torch
from conftest import HF_EOS, HF_TEXT, char_tokenizer, make_run, rows_by_step, run_group, run_main

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


@pytest.mark.parametrize("finetune", ["lora", "qlora"])
def test_lora_distills_from_the_start_its_adapters_off_which_it_equals_at_step_1(teacher, capsys, finetune):
    """finetune=lora (qlora: on the NF4 base) with frozen.teacher=start: the teacher is the student with its
    adapters off (no second copy); at step 1 the adapters' B is 0, so the divergence is exactly 0, then it
    grows."""
    run = teacher / "runs" / "teacher"
    args = tiny(teacher, f"d-{finetune}", 2, 64, "objective=distill", "teacher=start", f"init_from={run}")
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
    code, out, err = run_main(capsys, "train", *args, *lora, "distill.beta=0.5", "optim.lr=1e-2")
    assert code == 0, err
    rows = rows_by_step(teacher / "runs" / f"d-{finetune}")
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
    # the same tokenizer, padded to another model.vocab_size
    code, _, err = run_main(capsys, "train", *base, "vocab_multiple=100")
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: frozen.teacher={run} has model.vocab_size 256, the policy")
    assert "their logits must line up" in last
    assert not (teacher / "runs" / "bad-vocab" / "checkpoints").exists()


def test_distill_flops_count_the_teachers_forward():
    class Counts:
        forward_dense, forward_causal = 2.0, 1.5

    assert Distill.flops(Counts(), 6.0, 4.5) == (8.0, 6.0)


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
