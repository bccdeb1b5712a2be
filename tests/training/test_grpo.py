"""GRPO (objective=grpo, data=prompts): the loss is the papers' formulas (GRPO, Dr. GRPO, DAPO; clipped ratio,
k3 KL) on fixed log-probs, the advantages are group-relative, the rewards check what they say and the user's
function is announced and refused in one line when it fails; a run samples, scores and trains, resumes after a
kill -9 mid-step to the same rows and weights, follows one process on 2 (FSDP2, then DDP), and runs with LoRA
(the reference its adapters off), Muon and task evals.
"""

import json
import math

import pytest
import torch
from conftest import from_sft, run_cli, run_group, run_main, sft_start, write_jsonl
from conftest import rows_by_step as rows_of

import gptkit
from gptkit.errors import ConfigError, GptkitError
from gptkit.training.objectives.grpo import check_grpo_config, group_advantages, grpo_loss
from gptkit.training.objectives.grpo_loss import is_weights
from gptkit.training.rewards import last_number, load_rewards, parse_rewards

# ---- the loss -------------------------------------------------------------------------------------------
# three completions of 3, 1 and 2 tokens: per-token log-probs of the policy, of the policy that sampled them
# and of the reference, and their advantages
LOGP = [[-1.2, -0.3, -2.0], [-0.7], [-1.5, -0.1]]
OLD = [[-1.0, -0.5, -1.6], [-0.9], [-1.2, -0.4]]
REF = [[-1.1, -0.2, -2.3], [-0.5], [-1.9, -0.2]]
ADV = [1.3, -0.8, -0.5]


def papers_loss(kind, eps_low, eps_high, beta, max_new_tokens=4, kl="k3"):
    """The loss in float64 from math alone:
        l_it = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta KL_it,  r = exp(logp - old),
        KL = exp(ref - logp) - (ref - logp) - 1 (k3), times r (unclipped) with kl=k3_ratio (TRL's
        use_bias_correction_kl);
    grpo: mean over completions of their token means (DeepSeekMath eq. 3), dr_grpo: token sum / (completions
    x max_new_tokens) (Dr. GRPO), dapo: token sum / tokens (DAPO eq. 8); gspo: grpo's with r the sequence
    ratio s_i = (prod_t exp(logp_t - old_t))^(1/|o_i|) for every token (GSPO eq. 5-7); cispo: l_it = -min(r,
    1 + eps_high) A logp + beta KL_it, dapo's normalization (MiniMax-M1 eq. 4, no lower clip)."""
    per_completion, total, tokens = [], 0.0, 0
    for lp, old, ref, a in zip(LOGP, OLD, REF, ADV):
        s = 0.0
        seq_ratio = math.prod(math.exp(p - o) for p, o in zip(lp, old)) ** (1 / len(lp))
        for p, o, r in zip(lp, old, ref):
            ratio = seq_ratio if kind == "gspo" else math.exp(p - o)
            if kind == "cispo":
                s += -min(ratio, 1 + eps_high) * a * p
            else:
                s += -min(ratio * a, min(max(ratio, 1 - eps_low), 1 + eps_high) * a)
            s += beta * (math.exp(r - p) - (r - p) - 1) * (ratio if kl == "k3_ratio" else 1.0)
        per_completion.append(s / len(lp))
        total, tokens = total + s, tokens + len(lp)
    return {
        "grpo": sum(per_completion) / len(LOGP),
        "gspo": sum(per_completion) / len(LOGP),
        "dr_grpo": total / (len(LOGP) * max_new_tokens),
        "dapo": total / tokens,
        "cispo": total / tokens,
    }[kind]


def padded(rows):
    out = torch.zeros(len(rows), 3, dtype=torch.float64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
    return out


MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)


@pytest.mark.parametrize("kl", ["k3", "k3_ratio"])
@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
@pytest.mark.parametrize(
    "eps_low, eps_high, beta", [(0.2, 0.2, 0.0), (0.2, 0.28, 0.04), (0.1, 0.3, 0.5), (0.05, 0.1, 0.0)]
)
def test_the_loss_is_the_papers_formulas_on_fixed_log_probs(kind, eps_low, eps_high, beta, kl):
    # garbage on the padding: the mask keeps it out
    logp = padded(LOGP) + (~MASK) * 7.0
    value, figures = grpo_loss(
        logp.float(),
        padded(OLD).float(),
        torch.tensor(ADV),
        MASK,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        beta=beta,
        ref_logps=padded(REF).float(),
        loss=kind,
        max_new_tokens=4,
        kl=kl,
    )
    assert abs(float(value) - papers_loss(kind, eps_low, eps_high, beta, kl=kl)) < 1e-6
    assert float(figures["tokens"]) == 6
    ratios = [math.exp(p - o) for lp, old in zip(LOGP, OLD) for p, o in zip(lp, old)]
    signs = [a for lp, a in zip(LOGP, ADV) for _ in lp]
    if kind == "gspo":
        # each completion's sequence ratio, clipped as a whole: counted over the completions
        seq = [math.exp(sum(p - o for p, o in zip(lp, old)) / len(lp)) for lp, old in zip(LOGP, OLD)]
        clipped = sum((r < 1 - eps_low and a < 0) or (r > 1 + eps_high and a > 0) for r, a in zip(seq, ADV))
        assert float(figures["clip_units"]) == 3
        ratios = [r for r, lp in zip(seq, LOGP) for _ in lp]
    elif kind == "cispo":
        # the weights clipped above where A > 0 (as TRL's cispo_clip_ratio counts them)
        clipped = sum(r > 1 + eps_high and a > 0 for r, a in zip(ratios, signs))
    else:
        clipped = sum(
            (r < 1 - eps_low and a < 0) or (r > 1 + eps_high and a > 0) for r, a in zip(ratios, signs)
        )
    assert float(figures["clipped"]) == clipped
    # the KL term as the loss has it (TRL logs the same)
    weight = ratios if kl == "k3_ratio" else [1.0] * len(ratios)
    terms = [math.exp(r - p) - (r - p) - 1 for lp, ref in zip(LOGP, REF) for p, r in zip(lp, ref)]
    assert abs(float(figures["kl"]) - sum(t * w for t, w in zip(terms, weight))) < 1e-5


def test_the_first_pass_gradient_is_the_advantage_over_the_completions_length():
    # pi_old = pi, detached: ratio 1, d loss / d logp_it = -A_i / (|o_i| G) for grpo
    logp = padded(LOGP).requires_grad_(True)
    value, _ = grpo_loss(
        logp, logp.detach(), torch.tensor(ADV, dtype=torch.float64), MASK, epsilon_low=0.2, epsilon_high=0.2
    )
    value.backward()
    want = torch.tensor([[-a / (len(lp) * 3)] * 3 for lp, a in zip(LOGP, ADV)], dtype=torch.float64) * MASK
    assert torch.allclose(logp.grad, want, atol=1e-12)


def test_is_correction_weighs_each_tokens_policy_term_by_the_truncated_ratio_to_the_sampler():
    """grpo.is_correction=cap: w_t = min(exp(old_t - sampled_t), cap), detached (TRL's token_truncate), times
    the policy term of each token before the KL term is added."""
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    sampled = torch.tensor([[-1.0, -2.5, 0.5]], dtype=torch.float64)
    w = is_weights(old, sampled, 1.5)
    assert torch.allclose(w, torch.tensor([[1.0, 1.5, math.exp(-1.0)]], dtype=torch.float64), atol=1e-12)
    logp = torch.tensor([[-0.9, -2.2, -0.4]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.1, -2.0, -0.6]], dtype=torch.float64)
    mask, adv = torch.ones(1, 3), torch.tensor([0.7], dtype=torch.float64)
    kwargs = dict(epsilon_low=0.2, epsilon_high=0.2, beta=0.1, ref_logps=ref)
    value, _ = grpo_loss(logp, old, adv, mask, **kwargs, is_weight=w)
    rho = [math.exp(a - b) for a, b in zip(logp[0].tolist(), old[0].tolist())]
    policy = [-min(r * 0.7, min(max(r, 0.8), 1.2) * 0.7) for r in rho]
    kl = [math.exp(r - p) - (r - p) - 1 for p, r in zip(logp[0].tolist(), ref[0].tolist())]
    want = sum(p * x + 0.1 * k for p, x, k in zip(policy, w[0].tolist(), kl)) / 3
    assert float(value) == pytest.approx(want, abs=1e-12)
    value.backward()
    # the weight is detached: the gradient of w_t x (policy term), not of w_t
    assert logp.grad is not None and not w.requires_grad


def test_the_progress_line_says_the_sampler_trainer_mismatch():
    from types import SimpleNamespace

    from gptkit.training.objectives.grpo import GRPO

    o = object.__new__(GRPO)
    o.rewards = SimpleNamespace(rewards=[])
    line = GRPO.progress(o, {"train/reward": 0.5, "train/rollout_logprob_diff": 0.0})
    assert line == ["reward 0.500  logprob diff 0"]
    assert (
        "logprob diff 3.1e-05"
        in GRPO.progress(o, {"train/reward": 0.5, "train/rollout_logprob_diff": 3.1e-5})[0]
    )


def test_gspo_clips_whole_completions_and_cispo_keeps_every_tokens_gradient():
    """GSPO: d l / d logp_it = -A_i s_i / (|o_i| G) where s_i is inside [1 - eps_low, 1 + eps_high] (or on the
    side the min does not pick), else 0 for every token of completion i. CISPO: -min(r_it, 1 + eps_high) A_i /
    tokens for every token, clipped or not (the weight is detached)."""
    lp = [[-1.0, -0.5], [-0.3, -0.2, -0.9], [-0.5]]
    old = [[-1.2, -0.6], [-0.2, -0.1, -0.9], [-0.55]]
    adv = [1.0, -2.0, 0.7]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    grads, figures = {}, {}
    for kind in ("gspo", "cispo"):
        logp = padded(lp).requires_grad_(True)
        value, figures[kind] = grpo_loss(
            logp,
            padded(old),
            torch.tensor(adv, dtype=torch.float64),
            mask,
            epsilon_low=0.05,
            epsilon_high=0.1,
            loss=kind,
        )
        value.backward()
        grads[kind] = logp.grad
    for i, (p, o, a) in enumerate(zip(lp, old, adv)):
        s = math.exp(sum(x - y for x, y in zip(p, o)) / len(p))  # 1.16, 0.94, 1.05
        inside = not ((s > 1.1 and a > 0) or (s < 0.95 and a < 0))
        for t, (x, y) in enumerate(zip(p, o)):
            want = -a * s / (len(p) * 3) if inside else 0.0
            assert abs(float(grads["gspo"][i, t]) - want) < 1e-12, (i, t)
            want = -min(math.exp(x - y), 1.1) * a / 6
            assert abs(float(grads["cispo"][i, t]) - want) < 1e-12, (i, t)
    # the first two completions clipped, the third not: a share of the completions
    assert float(figures["gspo"]["clipped"]) == 2 and float(figures["gspo"]["clip_units"]) == 3
    # the first completion's tokens are above 1.1 with A > 0 (1.22, 1.11): both counted; the rest not
    assert float(figures["cispo"]["clipped"]) == 2


def test_k3_ratio_changes_the_kl_gradient_even_in_the_first_pass():
    """grpo.kl=k3_ratio (TRL's use_bias_correction_kl): rho = 1 in a first pass, but its gradient is not 0:
    d(beta k3 rho)/d logp = beta ((1 - exp(ref - logp)) + k3); k3 alone gives beta (1 - exp(ref - logp))."""
    beta, grads = 0.5, {}
    for kl in ("k3", "k3_ratio"):
        logp = padded(LOGP).requires_grad_(True)
        value, _ = grpo_loss(
            logp,
            logp.detach(),
            torch.zeros(3, dtype=torch.float64),
            MASK,
            epsilon_low=0.2,
            epsilon_high=0.2,
            beta=beta,
            ref_logps=padded(REF),
            loss="dapo",
            kl=kl,
        )
        value.backward()
        grads[kl] = logp.grad
    for i, (lp, ref) in enumerate(zip(LOGP, REF)):
        for t, (p, r) in enumerate(zip(lp, ref)):
            k3 = math.exp(r - p) - (r - p) - 1
            assert abs(float(grads["k3"][i, t]) - beta * (1 - math.exp(r - p)) / 6) < 1e-12
            assert abs(float(grads["k3_ratio"][i, t]) - beta * (1 - math.exp(r - p) + k3) / 6) < 1e-12


def test_advantages_are_relative_to_the_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 2.0]])
    none = group_advantages(rewards, "none")
    assert torch.allclose(none, rewards - rewards.mean(1, keepdim=True))
    scaled = group_advantages(rewards, "std")
    # the unbiased std, + 1e-4 (TRL's GRPOTrainer)
    std = torch.tensor([math.sqrt(1 / 3), 0.0, math.sqrt(2 / 3)])[:, None]
    assert torch.allclose(scaled, none / (std + 1e-4), atol=1e-6)
    # a group without reward variance teaches nothing
    assert scaled[1].abs().max() == 0


@pytest.mark.parametrize("loss, kl", [("grpo", "k3_ratio"), ("gspo", "k3")])
def test_grpo_loss_and_gradients_chunked_equal_the_unchunked_path(loss, kl, monkeypatch):
    """objective=grpo reads the per-token log-probs (at grpo.temperature) of the policy, of the policy that
    sampled (iterations 2) and of the reference from the model's chunked path (7 rows a chunk, straddling
    the rows of T = 17); loss and gradients equal the unchunked path's to 1e-6 in fp32. The rollouts are
    fixed (sample and _score stand in); the rest is the objective's own code."""
    from types import SimpleNamespace

    from conftest import assert_same, loss_and_grads, policy_and_reference

    from gptkit.inference.rollouts import RolloutOptions
    from gptkit.training.objectives.grpo import GRPO
    from gptkit.training.objectives.grpo_rows import Figures

    policy, reference = policy_and_reference(seed=5)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 7)]
    # 2 prompts x 3 completions of different lengths
    groups = [
        [
            SimpleNamespace(
                tokens=torch.randint(0, 96, (n,), generator=g).tolist(),
                stop_reason="stop",
                logprobs=[-4.0] * n,
            )
            for n in ns
        ]
        for ns in ((9, 12, 5), (3, 11, 8))
    ]
    totals = [[1.0, 0.0, 0.5], [0.0, 2.0, 1.0]]

    def grpo():
        o = object.__new__(GRPO)
        o.reference, o.frozen = reference, {"reference": reference}
        o.opts = RolloutOptions(12, 0.7, None, 1.0, ())
        o.mu, o.accumulation, o.batch_size, o.group_size = 2, 1, 2, 3
        o.kept_round, o.kept, o._clock, o.pad_id, o.scale = None, {}, None, 0, "std"
        o.epsilon, o.epsilon_high, o.beta, o.loss_type, o.kl = 0.2, 0.28, 0.04, loss, kl
        # gspo: with the truncated IS weights of the sampler's log-probs (-4 each), which both paths read
        o.invariant, o.is_cap, o.episodes = False, (2.0 if loss == "gspo" else None), None
        o.train = Figures(["r"])
        o.sample = lambda *a: (groups, 0.0)
        o._score = lambda batch, groups: ([[[t] for t in ts] for ts in totals], totals)
        return o

    batch = SimpleNamespace(step=0, ids=torch.zeros(2, 1), prompts=lambda: prompts)
    chunked = loss_and_grads(lambda m: grpo().loss(m, batch)[0], policy, monkeypatch, 7)
    whole = loss_and_grads(lambda m: grpo().loss(m, batch)[0], policy, monkeypatch, None)
    assert_same(chunked, whole)


@pytest.fixture(scope="module")
def defaults():
    """conf/train.yaml's grpo block."""
    from gptkit.conf_tree import compose

    return compose("train", []).grpo


@pytest.mark.parametrize(
    "grpo, message",
    [
        ({"group_size": 1}, "grpo.group_size=1 must be an integer >= 2"),
        ({"loss": "ppo"}, "grpo.loss='ppo' is not one of grpo, dr_grpo, dapo, gspo, cispo"),
        ({"scale": "batch"}, "grpo.scale='batch' is not one of std, none"),
        ({"beta": -0.1}, "grpo.beta=-0.1 must be >= 0"),
        ({"epsilon": 1.5}, "grpo.epsilon=1.5 must be in"),
        ({"temperature": 0.0}, "grpo.temperature must be > 0"),
        ({"iterations": 0}, "grpo.iterations=0 must be an integer >= 1"),
        ({"rewards": []}, "objective=grpo needs rewards"),
        ({"rewards": ["exactly"]}, "grpo.rewards\\[0\\]='exactly' is neither a checker"),
        ({"rewards": [{"kind": "regex"}]}, "the regex checker needs a pattern"),
        ({"rewards": ["exact", "exact"]}, "grpo.rewards names exact more than once"),
        ({"rewards": [{"kind": "exact", "weight": 0}]}, "weight=0 must be a finite number, not 0"),
        ({"kl": "k2"}, "grpo.kl='k2' is not one of k3, k3_ratio"),
        ({"reward_timeout": -1}, "grpo.reward_timeout=-1 must be a number of seconds >= 0"),
        (
            {"val_samples": 4, "val_k": [1, 5], "val_temperature": 1.0},
            "grpo.val_k=5 is larger than the samples per item \\(grpo.val_samples=4\\)",
        ),
        ({"val_samples": 4}, "grpo.val_samples=4 needs grpo.val_temperature > 0"),
        ({"val_samples": 0}, "grpo.val_samples=0 must be an integer >= 1"),
        ({"is_correction": 0}, "grpo.is_correction=0 must be null \\(off\\) or the cap"),
        ({"is_correction": -2.0}, "grpo.is_correction=-2.0 must be null \\(off\\) or the cap"),
        ({"is_correction": True}, "grpo.is_correction=True must be null"),
        ({"is_correction": "high"}, "grpo.is_correction='high' must be null"),
        ({"batch_invariant": "yes"}, "grpo.batch_invariant='yes' must be true or false"),
    ],
)
def test_bad_grpo_settings_are_one_line(defaults, grpo, message):
    g = defaults.copy()
    g.update(grpo)
    with pytest.raises(ConfigError, match=message):
        check_grpo_config(g)


@pytest.mark.parametrize(
    "grpo, message",
    [
        ({"rollouts": "vllm"}, "grpo.rollouts='vllm' is not one of engine, groups"),
        ({"rollout_rows": 0}, "grpo.rollout_rows=0 must be null"),
    ],
)
def test_bad_rollout_settings_are_one_line(defaults, grpo, message):
    from gptkit.training.objectives.grpo import GRPO

    g = defaults.copy()
    g.update(grpo)
    with pytest.raises(ConfigError, match=message):
        GRPO.check_config(g)
    GRPO.check_config(defaults)


# ---- rewards ------------------------------------------------------------------------------------------
def test_the_checkers_score_what_they_say():
    rewards = parse_rewards(
        [
            "exact",
            "contains",
            {"kind": "number", "field": "solution"},
            {"kind": "regex", "pattern": r"answer: (\w+)", "name": "tagged"},
            {"kind": "format", "weight": 0.5},
        ]
    )
    row = {"answer": "ABC", "solution": "so it is 1,234 #### 1234"}
    score = lambda text: rewards.score("p", text, row, "f line 1")  # noqa: E731
    assert score(" ABC\n") == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert score("so ABC is 1234.0") == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert score("answer: ABC, not 12") == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert score("<think>1,233 + 1</think> <answer>1,234</answer>") == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert rewards.total([1.0, 1.0, 0.0, 0.0, 1.0]) == 2.5 and rewards.names[3] == "tagged"
    assert [last_number(t) for t in ("x -3.5e2 y", "12 and 7.", "none", "1,000,000")] == [-350, 7, None, 1e6]
    with pytest.raises(
        GptkitError, match="^f line 1: reward exact reads the field 'answer', which this record"
    ):
        rewards.score("p", "x", {"solution": "1"}, "f line 1")


def test_val_samples_give_pass_at_k_of_each_checker_and_maj_at_k_of_its_answers():
    """SampledSums on 2 val prompts x 4 samples: pass@k is Chen et al.'s estimator over each checker's right
    samples, maj@k the majority of the extracted answers (a tie: the first seen); contains and format get no
    maj@k."""
    from gptkit.evaluation.sampled import pass_at_k
    from gptkit.training.objectives.grpo import SampledSums

    rewards = parse_rewards(["number", "contains", "format"])
    sums = SampledSums(rewards.rewards, [1, 2, 4])
    # a checker without an answer (contains, format): pass@k only
    assert (
        "pass@4/format" in sums.keys and "maj@1/format" not in sums.keys and "maj@2/contains" not in sums.keys
    )
    rows = [{"answer": "7"}, {"answer": "3"}]
    texts = [["so 7", "it is 9", "9", "7 it is"], ["3", "x", "y", "z"]]
    scores = [[rewards.score("p", t, row, "w") for t in group] for row, group in zip(rows, texts)]
    sums.add(scores, texts)
    got = sums.read(None, "cpu")
    for k in (1, 2, 4):
        want = (pass_at_k(4, 2, k) + pass_at_k(4, 1, k)) / 2
        assert got[f"val/pass@{k}/number"] == pytest.approx(want)
    # prompt 1: k=1 answer 7 (right); k=2 a tie of 7 and 9 (7 first); k=4 a tie (7 first). Prompt 2: 3 once,
    # every other sample no number (no vote): 3 wins
    assert [got[f"val/maj@{k}/number"] for k in (1, 2, 4)] == [1.0, 1.0, 1.0]
    sums.add([[rewards.score("p", t, rows[0], "w") for t in ("9", "7", "9", "7")]], [["9", "7", "9", "7"]])
    again = sums.read(None, "cpu")
    assert [again[f"val/maj@{k}/number"] for k in (1, 2, 4)] == [0.0, 0.0, 0.0]
    assert again["val/pass@1/contains"] == 0.5 and again["val/pass@2/contains"] == pytest.approx(5 / 6)


def test_a_users_reward_is_announced_and_refused_in_one_line_when_it_fails(tmp_path, capsys):
    f = tmp_path / "my_rewards.py"
    f.write_text(
        "def good(prompt, completion, row):\n"
        "    return len(completion) + len(row['answer']) + (prompt == 'p')\n"
        "def bad(prompt, completion, row):\n    raise ValueError('no ' + completion)\n"
        "def text(prompt, completion, row):\n    return 'high'\n"
        "def nan(prompt, completion, row):\n    return float('nan')\n"
    )
    rewards = load_rewards(parse_rewards([f"{f}:good", f"{f}:bad", f"{f}:text", f"{f}:nan"]))
    assert f"grpo.rewards runs {f} ({f}:good): use only reward code you trust" in capsys.readouterr().err
    good, bad, text, nan = rewards.rewards
    assert good("p", "abc", {"answer": "AB"}, "w") == 6.0
    with pytest.raises(
        GptkitError, match=f"^reward bad \\({f}:bad\\) raised ValueError: no x on the prompt of d"
    ):
        bad("p", "x", {}, "d line 3")
    with pytest.raises(
        GptkitError, match="returned 'high' \\(str\\) on the prompt of d line 3; a reward is a"
    ):
        text("p", "x", {}, "d line 3")
    with pytest.raises(GptkitError, match="returned 'nan' \\(float\\)"):
        nan("p", "x", {}, "d line 3")
    with pytest.raises(GptkitError, match="has no function missing"):
        load_rewards(parse_rewards([f"{f}:missing"]))
    with pytest.raises(ConfigError, match="is not a file"):
        load_rewards(parse_rewards([f"{tmp_path / 'none.py'}:fn"]))


MISBEHAVING = (
    "import os, signal, sys, time\n"
    "def leaves(prompt, completion, row):\n    sys.exit(0)\n"
    "def stops(prompt, completion, row):\n    raise KeyboardInterrupt\n"
    "def spins(prompt, completion, row):\n    while True:\n        pass\n"
    "def stubborn(prompt, completion, row):\n"
    "    try:\n        time.sleep(10)\n    except BaseException:\n        return 1.0\n"
    "def forever(prompt, completion, row):\n"
    "    while True:\n        try:\n            time.sleep(10)\n        except BaseException:\n"
    "            pass\n"
    "def naps(prompt, completion, row):\n    time.sleep(2)\n    return 1.0\n"
    "def huge(prompt, completion, row):\n    return 1e308\n"
    "def ctrl_c(prompt, completion, row):\n"
    "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(5)\n    return 1.0\n"
)


def test_a_reward_that_exits_interrupts_itself_or_never_returns_is_one_line(tmp_path):
    """sys.exit, a KeyboardInterrupt of the reward's own and a reward past grpo.reward_timeout (a loop that
    never returns, one that swallows the alarm) are one-line errors naming it and the prompt; no timer is left
    armed and the signal handlers are the ones before; the limit holds in a thread too."""
    import signal
    import subprocess
    import sys
    import threading

    f = tmp_path / "misbehaving.py"
    f.write_text(MISBEHAVING)
    rewards = load_rewards(parse_rewards([f"{f}:{n}" for n in ("leaves", "stops", "spins", "stubborn")]))
    leaves, stops, spins, stubborn = rewards.rewards
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM)
    with pytest.raises(
        GptkitError, match=f"^reward leaves \\({f}:leaves\\) called sys.exit\\(0\\) on the prompt of d"
    ):
        leaves("p", "x", {}, "d line 3", 0.2)
    with pytest.raises(
        GptkitError, match=f"^reward stops \\({f}:stops\\) raised KeyboardInterrupt on the prompt of d"
    ):
        stops("p", "x", {}, "d line 3", 0.2)
    for r in (spins, stubborn):
        said = f"^reward {r.name} \\({f}:{r.name}\\) did not return within grpo.reward_timeout=0.2 s on "
        with pytest.raises(GptkitError, match=said + "the prompt of d line 3"):
            r("p", "x", {}, "d line 3", 0.2)
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM)) == handlers
    # the handlers installed once for a batch's calls (GRPO's scoring): the same errors, the same restoring
    with rewards.guard():
        with pytest.raises(GptkitError, match="^reward spins .* did not return within"):
            spins("p", "x", {}, "d line 3", 0.2)
        with pytest.raises(GptkitError, match="^reward stops .* raised KeyboardInterrupt"):
            stops("p", "x", {}, "d line 3", 0.2)
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM)) == handlers
    # no SIGALRM outside the main thread: the call is abandoned in a daemon thread (this one ends in 2 s)
    (naps,) = load_rewards(parse_rewards([f"{f}:naps"])).rewards
    caught = []
    t = threading.Thread(
        target=lambda: caught.append(pytest.raises(GptkitError, naps, "p", "x", {}, "d line 3", 0.2))
    )
    t.start()
    t.join(30)
    assert "reward naps" in str(caught[0].value) and "did not return within" in str(caught[0].value)
    # a reward that catches every stop (a bare except in a loop): the line, then the process ends (exit 2)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from gptkit.training.rewards import load_rewards, parse_rewards\n"
            f"(r,) = load_rewards(parse_rewards([{f'{f}:forever'!r}]), announce=False).rewards\n"
            "r('p', 'x', {}, 'd line 3', 0.2)\n",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.startswith(f"error: reward forever ({f}:forever) did not return")


def test_a_real_ctrl_c_during_a_reward_is_a_ctrl_c(tmp_path):
    """A SIGINT that arrives during a reward goes to the process's handler (training's: finish the step and
    save; a second one: stop): its KeyboardInterrupt is not turned into a reward error."""
    f = tmp_path / "ctrl_c.py"
    f.write_text(MISBEHAVING)
    (ctrl_c,) = load_rewards(parse_rewards([f"{f}:ctrl_c"])).rewards
    with pytest.raises(KeyboardInterrupt):
        ctrl_c("p", "x", {}, "d line 3", 30)


def test_a_total_reward_that_overflows_is_one_line_naming_each_reward(tmp_path):
    f = tmp_path / "big.py"
    f.write_text(MISBEHAVING)
    rewards = load_rewards(
        parse_rewards([{"function": f"{f}:huge", "name": "a"}, {"function": f"{f}:huge", "name": "b"}])
    )
    scores = rewards.score("p", "x", {}, "d line 3")
    assert scores == [1e308, 1e308]
    with pytest.raises(
        GptkitError,
        match="^the total reward is inf \\(1 x a 1e\\+308, 1 x b 1e\\+308\\) on the prompt of d line 3",
    ):
        rewards.total(scores, "d line 3")


def test_a_dotted_reward_module_is_announced_before_its_package_runs(tmp_path, monkeypatch, capfd):
    pkg = tmp_path / "announced_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import sys\nprint('package code ran', file=sys.stderr)\n")
    (pkg / "scores.py").write_text("def one(prompt, completion, row):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (r,) = load_rewards(parse_rewards(["announced_pkg.scores:one"])).rewards
    err = capfd.readouterr().err
    said = f"grpo.rewards runs {pkg / 'scores.py'} (announced_pkg.scores:one): use only reward code you trust"
    assert said in err and "package code ran" in err
    assert err.index(said) < err.index("package code ran")
    assert r("p", "x", {}, "w") == 1.0
    with pytest.raises(ConfigError, match="reward module 'announced_pkg.missing' cannot be found"):
        load_rewards(parse_rewards(["announced_pkg.missing:one"]))


def test_user_code_that_fails_on_import_is_one_line_for_rewards_and_chat_tools(tmp_path, monkeypatch, capfd):
    """gptkit/user_code.py, shared by grpo.rewards and `gptkit chat tools=`: a module that raises or exits
    while it is imported is one GptkitError line naming the option and the file, after its announcement."""
    from gptkit.errors import GptkitError
    from gptkit.inference.chat_tools import load_tools

    raising = tmp_path / "raising.py"
    raising.write_text("raise RuntimeError('boom')\n")
    exiting = tmp_path / "exiting.py"
    exiting.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(GptkitError, match=f"grpo.rewards: importing {raising} failed: RuntimeError: boom$"):
        load_rewards(parse_rewards([f"{raising}:f"]))
    with pytest.raises(GptkitError, match=f"tools={exiting}: importing {exiting} failed: SystemExit: 3$"):
        load_tools(str(exiting))
    err = capfd.readouterr().err
    assert f"grpo.rewards runs {raising}" in err and f"chat tools= runs {exiting}" in err


# ---- training -------------------------------------------------------------------------------------------
REWARD = (
    "def upper(prompt, completion, row):\n"
    "    return sum(c.isupper() for c in completion) / max(1, len(completion))\n"
)


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """An SFT start (2 steps of data=chat, chatml, byte), 40 prompts and a reward function's file."""
    import random

    root = tmp_path_factory.mktemp("grpo")
    rng, rows = random.Random(0), []
    for _ in range(40):
        w = "".join(rng.choice("abcdef") for _ in range(4))
        rows.append({"prompt": f"upper {w}", "answer": w.upper()})
    sft = write_jsonl(root / "sft.jsonl", [{"prompt": r["prompt"], "response": r["answer"]} for r in rows])
    write_jsonl(root / "prompts.jsonl", rows)
    (root / "rw.py").write_text(REWARD)
    sft_start(root, sft, seq_len=40)
    return root


def grpo_args(root, name, world=1, *extra):
    """4 prompts x 4 completions per step whatever the world size; a KL to the start, 2 passes per batch of
    rollouts; a step's checkpoint (3) falls inside a round (steps 2-3)."""
    return [
        "objective=grpo",
        f"init_from={root / 'sft'}",
        "data=prompts",
        f"data.paths=[{root / 'prompts.jsonl'}]",
        f"grpo.rewards=[{root / 'rw.py'}:upper,exact]",
        "grpo.group_size=4",
        "grpo.max_new_tokens=8",
        "grpo.beta=0.1",
        "grpo.iterations=2",
        *from_sft(root, name, world, *extra),
    ]


# what a resumed or distributed run must reproduce (the timings may differ)
KEYS = (
    "train/loss",
    "train/reward",
    "train/rewards/upper",
    "train/accuracy/exact",
    "train/kl",
    "train/clip_fraction",
    "train/completion_len",
    "train/groups_zero_std",
    "val/loss",
    "val/reward",
)


@pytest.fixture(scope="module")
def straight(start):
    gptkit.train(grpo_args(start, "straight"))
    return start / "straight"


def test_grpo_samples_scores_and_trains_and_resumes_after_a_kill_mid_step(start, straight):
    rows = rows_of(straight)
    assert sorted(s for s, r in rows.items() if r.get("train/loss")) == list(range(1, 7))
    first = rows[1]
    # the first pass: ratio 1, advantages summing to 0 in each group, the policy is the reference
    assert abs(float(first["train/loss"])) < 1e-6 and float(first["train/kl"]) == 0.0
    assert float(first["train/clip_fraction"]) == 0.0 and 0 < float(first["train/rewards/upper"]) < 1
    assert 1 <= float(first["train/completion_len"]) <= float(first["train/completion_len_max"]) <= 8
    # grpo.batch_invariant (the default): the sampler's log-probs are the trainer's, bit for bit, every step
    assert all(float(r["train/rollout_logprob_diff"]) == 0.0 for r in rows.values() if r.get("train/loss"))
    # rollouts are sampled every 2 steps: the second pass has no reward of its own, a ratio that moved
    assert rows[2]["train/reward"] == "" and float(rows[2]["train/kl"]) > 0
    assert float(rows[2]["time/generation_s"]) == 0 and float(rows[1]["time/generation_share"]) > 0
    assert all(
        rows[s]["val/reward"] and float(rows[s]["val/loss"]) == -float(rows[s]["val/reward"]) for s in (3, 6)
    )
    # killed in step 5 (sampling its rollouts), after step 3's checkpoint (inside the round of steps 2-3)
    killed = start / "killed"
    r = run_cli("train", *grpo_args(start, "killed"), env={"GPTKIT_FAULT": "rollout@5"})
    assert r.returncode == -9, r.stderr[-3000:]
    assert f"grpo.rewards runs {start / 'rw.py'}" in r.stderr
    gptkit.train([f"resume={killed}", f"runs_dir={start}", "name=killed"])
    again = rows_of(killed)
    assert [[r.get(k) for k in KEYS] for r in again.values()] == [
        [r.get(k) for k in KEYS] for r in rows.values()
    ]
    want = torch.load(straight / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    got = torch.load(killed / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(v, want[k]) for k, v in got.items())


def test_bench_grpo_reads_a_runs_step_and_sampling_times_and_compares_the_samplers(straight):
    """gptkit bench grpo's figures: a run's steps, seconds sampling and the rest of its steps (metrics.csv,
    validations left out); per thread count each sampler's mean step time and share, and the first sampler's
    times over the others'."""
    from gptkit.bench.grpo import _metrics, compare

    steps, sampling, rest = _metrics(straight)
    rows = rows_of(straight).values()
    assert steps == 6 and sampling == pytest.approx(sum(float(r.get("time/generation_s") or 0) for r in rows))
    assert sampling > 0 and rest > 0
    run = dict(steps=10, sampling_s=3.0, training_s=1.0, after=0.5)
    runs = [
        {**run, "threads": 1, "sampler": "groups"},
        {**run, "threads": 1, "sampler": "engine", "sampling_s": 1.0, "after": 0.4},
        {**run, "threads": 1, "sampler": "engine", "sampling_s": 0.5, "after": 0.5, "seed": 1},
    ]
    (one,) = compare(runs, ["groups", "engine"])
    groups, engine = one["samplers"]["groups"], one["samplers"]["engine"]
    assert (groups["step_ms"], groups["sampling_share"]) == (400.0, 0.75)
    assert engine["step_ms"] == pytest.approx(175.0) and engine["sampling_ms"] == pytest.approx(75.0)
    assert engine["step_speedup"] == pytest.approx(400 / 175)
    assert engine["sampling_speedup"] == pytest.approx(4.0)
    assert engine["after"] == [0.4, 0.5] and engine["after_spread"] == pytest.approx(0.1)


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_gspo_and_cispo_train_end_to_end_over_two_passes(start, straight, loss, capfd):
    # step 1 samples and passes once (ratio 1), step 2 passes again over the same rollouts (the ratio moved)
    gptkit.train(grpo_args(start, f"loss-{loss}", 1, f"grpo.loss={loss}", "trainer.max_steps=2"))
    err = capfd.readouterr().err
    assert {
        "gspo": "gspo loss, the sequence ratio clipped to [0.8, 1.2]",
        "cispo": "the IS weight clipped at 1.2",
    }[loss] in err, err
    rows, base = rows_of(start / f"loss-{loss}"), rows_of(straight)
    # the same rollouts as grpo's in step 1: the same start, seed and sampling
    assert rows[1]["train/reward"] == base[1]["train/reward"]
    if loss == "gspo":
        # ratio 1 and KL 0 in the first pass: -mean(A), grpo's value
        assert float(rows[1]["train/loss"]) == pytest.approx(float(base[1]["train/loss"]), abs=1e-6)
    # the second pass measured a moved policy: a KL above 0 and a clip fraction in [0, 1]
    assert float(rows[1]["train/kl"]) == 0.0 and float(rows[2]["train/kl"]) > 0
    assert 0.0 <= float(rows[2]["train/clip_fraction"]) <= 1.0
    assert math.isfinite(float(rows[2]["train/loss"])) and float(rows[2]["train/loss"]) != float(
        rows[1]["train/loss"]
    )


def test_eval_samples_the_answers_of_checked_prompts_pass_at_k_and_maj_at_k(start, capsys):
    """`gptkit eval data=prompts samples=4`: gptkit's own answer-checked prompts (the GRPO prompts, the
    exact checker and a regex one a random sample passes about half the time) scored by pass@k and maj@k of
    4 keyed samples each; the figures are the estimators over the samples it reports, and a rerun draws the
    same samples."""
    import re

    from gptkit.evaluation.sampled import majority, pass_at_k

    args = [
        "eval",
        f"run={start / 'sft'}",
        "data=prompts",
        f"data.paths=[{start / 'prompts.jsonl'}]",
        "samples=4",
        "k=[1,2,4]",
        "rewards=[exact,{kind: regex, pattern: '[a-z]', field: null, name: lower}]",
        "temperature=2.0",
        "max_new_tokens=6",
        "--json",
    ]
    code, out, err = run_main(capsys, *args)
    assert code == 0, err
    res = json.loads(out)
    assert len(res["items"]) == 40 and res["rewards"] == ["exact", "lower"]
    rows = {r["metric"]: r for r in res["rows"]}
    answers = [json.loads(line)["answer"] for line in (start / "prompts.jsonl").read_text().splitlines()]
    for k in (1, 2, 4):
        right = [[t.strip() == a for t in item["texts"]] for item, a in zip(res["items"], answers)]
        assert [[s[0] == 1.0 for s in item["scores"]] for item in res["items"]] == right
        want = sum(pass_at_k(4, sum(r), k) for r in right) / 40
        assert (
            rows[f"pass@{k} (exact)"]["value"] == pytest.approx(want) and rows[f"pass@{k} (exact)"]["n"] == 40
        )
        maj = [
            float(majority([t.strip() or None for t in item["texts"][:k]]) == a)
            for item, a in zip(res["items"], answers)
        ]
        assert rows[f"maj@{k} (exact)"]["value"] == pytest.approx(sum(maj) / 40)
    # the regex checker without a field (1 when a lower-case letter occurs): pass@k only, no answer to vote
    lower = [[bool(re.search("[a-z]", t)) for t in item["texts"]] for item in res["items"]]
    assert [[s[1] == 1.0 for s in item["scores"]] for item in res["items"]] == lower
    for k in (1, 2, 4):
        want = sum(pass_at_k(4, sum(r), k) for r in lower) / 40
        assert rows[f"pass@{k} (lower)"]["value"] == pytest.approx(want)
    assert "maj@1 (lower)" not in rows
    assert 0 < rows["pass@1 (lower)"]["value"] < rows["pass@4 (lower)"]["value"] <= 1
    code, again, err = run_main(capsys, *args)
    assert code == 0 and json.loads(again)["items"] == res["items"]
    code, _, err = run_main(capsys, *args[:4], "k=[2]")
    assert code == 2 and err.strip().splitlines() == [
        "error: data=prompts is scored by sampling its answers: give samples=n (and rewards=[exact] or other "
        "checkers); eval scores windows of a text corpus otherwise"
    ], err


def test_grpo_loss_is_not_judged_for_spikes(start, monkeypatch):
    """A policy-gradient loss sits around 0 by construction (Objective.loss_spikes is False): the spike watch
    never sees it, whatever trainer.spike_factor says."""
    from gptkit.training import metrics

    seen = []
    monkeypatch.setattr(metrics.SpikeWatch, "observe", lambda self, loss: seen.append(loss))
    gptkit.train(
        grpo_args(start, "spikes", 1, "trainer.max_steps=2", "trainer.val_every=2", "grpo.iterations=1")
    )
    assert seen == []


@pytest.mark.long
def test_grpo_on_2_processes_follows_one_process_fsdp_then_ddp(start, straight):
    def run(*args):
        r = run_group("-m", "gptkit", "train", *args)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    # FSDP2 (every forward collective: the ranks decode in lockstep), stopped inside a round of rollouts
    run(
        *grpo_args(
            start,
            "two",
            2,
            "trainer=fsdp",
            "trainer.devices=2",
            "trainer.precision=32-true",
            "trainer.stop_at_step=3",
        )
    )
    # DDP continues it: the round's rollouts of both ranks come from the checkpoint
    run(
        f"resume={start / 'two'}",
        f"runs_dir={start}",
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.batch_size=2",
    )
    want, got = rows_of(straight), rows_of(start / "two")
    for step in range(1, 7):
        for key in KEYS:
            if want[step].get(key):
                assert abs(float(got[step][key]) - float(want[step][key])) < 1e-5, (step, key)


@pytest.mark.long
def test_cispo_on_2_ddp_processes_follows_one_process(start):
    """cispo (as dapo) weighs every completion token of the step the same: each rank's loss carries its token
    count, so 2 ranks of 2 prompts give what one process of 4 gives; 2 steps: one round of rollouts, its
    second pass with a moved ratio (the clip acts). grpo, dr_grpo and gspo weigh every micro-batch the same,
    as the grpo loss of test_grpo_on_2_processes_follows_one_process_fsdp_then_ddp."""
    extra = ("grpo.loss=cispo", "grpo.epsilon_high=0.05", "trainer.max_steps=2", "trainer.val_every=2")
    gptkit.train(grpo_args(start, "cispo-one", 1, *extra))
    r = run_group(
        "-m", "gptkit", "train", *grpo_args(start, "cispo-two", 2, *extra, "trainer=ddp", "trainer.devices=2")
    )
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = rows_of(start / "cispo-one"), rows_of(start / "cispo-two")
    assert float(want[2]["train/kl"]) > 0
    for step in (1, 2):
        for key in KEYS:
            if want[step].get(key):
                assert abs(float(got[step][key]) - float(want[step][key])) < 1e-5, (step, key)


def test_grpo_with_qlora_measures_its_kl_against_the_nf4_base(start):
    """finetune=qlora: the policy samples with its adapters on the NF4 base, the KL's reference is that base
    (the adapters off): 0 in the first pass, then above 0 (2 passes over one round of rollouts)."""
    q = ("finetune=qlora", "qlora.block_size=32", "qlora.scaler_block_size=8", "lora.rank=4")
    gptkit.train(grpo_args(start, "qlora", 1, *q, "trainer.max_steps=2", "trainer.val_every=2"))
    rows = rows_of(start / "qlora")
    assert float(rows[1]["train/kl"]) == 0.0 and float(rows[2]["train/kl"]) > 0, rows
    ckpt = torch.load(start / "qlora" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["gptkit_lora"]["quantized"]["format"] == "nf4"


def test_grpo_with_lora_muon_dapo_accumulation_and_task_evals(start, capfd):
    gptkit.train(
        grpo_args(
            start,
            "lora",
            2,
            "trainer.accumulate_grad_batches=2",
            "finetune=lora",
            "lora.rank=4",
            "lora.targets=[q,k,v,o]",
            "optim=muon",
            "grpo.loss=dapo",
            "grpo.iterations=1",
            "trainer.max_steps=2",
            "trainer.val_every=2",
            "trainer.eval_tasks=[tests/evals/tiny_gen.yaml]",
            "trainer.eval_every=2",
            "trainer.eval_limit=2",
            "grpo.val_samples=4",
            "grpo.val_temperature=1.0",
            "grpo.val_k=[1,2]",
            "grpo.batch_invariant=false",
            "grpo.is_correction=2",
        )
    )
    err = capfd.readouterr().err
    assert "KL (k3) to the base with the adapters off, beta 0.1" in err and "2 prompts x 4 completions" in err
    assert "torch's forwards (not batch-invariant), IS correction capped at 2" in err, err
    rows = rows_of(start / "lora")
    # torch's own forwards: the mismatch is measured (0 or not), and the share of weights at the cap
    assert all(0 <= float(rows[s]["train/rollout_logprob_diff"]) < 1e-3 for s in (1, 2))
    assert all(0 <= float(rows[s]["train/is_capped"]) <= 1 for s in (1, 2))
    # B = 0: the policy is the base, the KL 0
    assert float(rows[1]["train/kl"]) == 0.0 and float(rows[2]["train/kl"]) > 0
    assert rows[2]["eval/tiny_gen/exact_match"] != "" and rows[2]["val/reward"] != ""
    # 4 samples of each val prompt over 2 ranks: pass@1 is the mean accuracy of every sample
    val = rows[2]
    assert float(val["val/pass@1/exact"]) == pytest.approx(float(val["val/accuracy/exact"]))
    assert float(val["val/pass@1/exact"]) <= float(val["val/pass@2/exact"]) <= 1.0
    assert 0.0 <= float(val["val/maj@2/exact"]) <= 1.0 and "val/pass@4/exact" not in val


def test_grpo_on_a_hybrid_decodes_its_rollouts_through_the_recurrent_state_and_trains(start, monkeypatch):
    """GRPO from a Gated DeltaNet + softmax hybrid, LoRA on the projections of both layers (z and ba too):
    its rollouts go through the same sampler, the linear layer decoding each new token from the state its
    cache carries (the step-by-step delta rule), and the adapters train away from the base."""
    from gptkit.model import gated_deltanet

    sft = sft_start(start, start / "sft.jsonl", seq_len=40, hybrid=True, name="sft-hybrid")
    real, steps = gated_deltanet.recurrent_gated_delta_rule, []

    def counted(q, k, v, g, beta, initial_state=None, resets=None):
        steps.append(initial_state is not None and q.shape[1] == 1)
        return real(q, k, v, g, beta, initial_state, resets)

    monkeypatch.setattr(gated_deltanet, "recurrent_gated_delta_rule", counted)
    extra = ("finetune=lora", "lora.rank=4", "lora.targets=[q,k,v,o,z,ba]", "trainer.max_steps=2")
    args = grpo_args(start, "hybrid", 1, *extra, "trainer.val_every=2")
    gptkit.train([f"init_from={sft}" if a.startswith("init_from=") else a for a in args])
    rows = rows_of(start / "hybrid")
    # B = 0: the policy is the base, the KL 0; the second pass over the rollouts has moved it
    assert abs(float(rows[1]["train/loss"])) < 1e-6 and float(rows[1]["train/kl"]) == 0.0
    assert float(rows[2]["train/kl"]) > 0 and 0 < float(rows[1]["train/rewards/upper"]) < 1
    # 4 prompts x (up to 8 new tokens, the first from the prompt's forward) in step 1; the validation's too
    assert len(steps) >= 4 and all(steps)


def test_bad_grpo_commands_exit_2_with_one_line(start, capsys):
    f = start / "prompts.jsonl"
    base = [f"runs_dir={start / 'bad'}", "name=bad", "trainer.accelerator=cpu", "trainer.progress=false"]
    grpo = ["objective=grpo", "data=prompts", f"data.paths=[{f}]", f"init_from={start / 'sft'}"]
    (start / "raising.py").write_text("def fn(prompt, completion, row):\n    raise KeyError(row['answer'])\n")
    long = write_jsonl(start / "long.jsonl", [{"prompt": "upper " + "a" * 40, "answer": "x"}] * 3)
    bad = start / "misbehaving.py"
    bad.write_text(MISBEHAVING)
    for args, message in [
        (
            ["objective=grpo", "data=prompts", f"data.paths=[{f}]"],
            "objective=grpo needs a starting checkpoint",
        ),
        ([*grpo, "grpo.group_size=1"], "grpo.group_size=1 must be an integer >= 2"),
        (["data=prompts", f"data.paths=[{f}]"], "data=prompts holds prompts for reinforcement learning"),
        (
            ["objective=grpo", "data=chat", f"data.paths=[{f}]", "init_from=x"],
            "objective=grpo trains on prompts",
        ),
        (
            [*grpo, "trainer.compile=true"],
            "objective=grpo decodes its completions through a growing KV cache",
        ),
        (
            [*grpo, f"data.paths=[{long}]", "data.val_paths=null"],
            f"{long} line 1: the prompt makes 65 tokens",
        ),
        (
            [*grpo, f"grpo.rewards=[{start / 'raising.py'}:fn]", "trainer.max_steps=1"],
            f"reward fn ({start / 'raising.py'}:fn) raised KeyError: '",
        ),
        # a reward's sys.exit(0) once ended the run with exit 0 and no word
        (
            [*grpo, f"grpo.rewards=[{bad}:leaves]", "trainer.max_steps=1"],
            f"reward leaves ({bad}:leaves) called sys.exit(0) on the prompt of {f} line ",
        ),
        (
            [*grpo, f"grpo.rewards=[{bad}:spins]", "grpo.reward_timeout=0.5", "trainer.max_steps=1"],
            f"reward spins ({bad}:spins) did not return within grpo.reward_timeout=0.5 s on the prompt of ",
        ),
        # two finite rewards whose sum is inf: once "loss became non-finite ... lower optim.lr"
        (
            [
                *grpo,
                f"grpo.rewards=[{{function: '{bad}:huge', name: a}},{{function: '{bad}:huge', name: b}}]",
                "trainer.max_steps=1",
            ],
            f"the total reward is inf (1 x a 1e+308, 1 x b 1e+308) on the prompt of {f} line ",
        ),
    ]:
        code, _, err = run_main(capsys, "train", *base, *args)
        line = err.strip().splitlines()[-1]
        assert code == 2 and line.startswith(f"error: {message}"), (args, err[-2000:])
    # the reward's failure names the prompt's file and line
    assert f"on the prompt of {f} line " in line


def test_the_plan_counts_each_prompts_completions_their_sampling_and_the_reference():
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from gptkit import accounting as acc
    from gptkit.conf_tree import compose
    from gptkit.model import ModelConfig
    from gptkit.precision import precision
    from gptkit.training.memory import chunked_logits_bytes, estimate
    from gptkit.training.plan import make_plan

    cfg = compose("train", ["model=llama-tiny", "trainer.batch_size=3", "trainer.accelerator=cpu"])
    model = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    lm = make_plan(cfg, None, model)
    cfg.objective = "grpo"
    cfg.grpo.group_size = 4
    grpo = make_plan(cfg, None, model)
    # 3 prompts x 4 completions
    assert grpo.rows == 12 and grpo.tokens_per_step == 4 * lm.tokens_per_step
    forward = acc.flops_per_token(model, lm.seq_len)
    # the sampling: a forward per token
    assert grpo.flops_per_token == pytest.approx(lm.flops_per_token + forward.forward_dense)
    # a KL term (a reference's forward) and 2 passes per batch of rollouts (the sampling policy's forward):
    # the three forwards once per 2 steps
    cfg.grpo.beta, cfg.grpo.iterations = 0.1, 2
    kl = make_plan(cfg, None, model)
    assert kl.flops_per_token == pytest.approx(lm.flops_per_token + 1.5 * forward.forward_dense)
    plan = SimpleNamespace(
        model=model,
        precision=precision("32-true"),
        shards=1,
        expert_shards=1,
        batch_size=3,
        seq_len=lm.seq_len,
        trainer=SimpleNamespace(activation_checkpointing=False),
        lora=None,
        objective="grpo",
        cfg=cfg,
    )
    mem = estimate(plan)
    # 12 sequences, their log-probs chunked, and the reference's copy of the weights
    assert mem["reference"] == mem["weights"]
    assert mem["logits"] == chunked_logits_bytes(12 * lm.seq_len, model)
    assert mem["logits"] < 4 * estimate(SimpleNamespace(**{**vars(plan), "objective": "lm"}))["logits"]
