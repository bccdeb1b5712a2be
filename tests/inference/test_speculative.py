"""Speculative decoding (gptkit/inference/speculative.py): greedy tokens identical to the plain decode for
every drafter, the rejection rule's output distributed as p (chi-square, seeded), chat, and
`gptkit sample draft=`."""

from types import SimpleNamespace

import pytest
import torch
from conftest import HYBRID_MODEL, greedy_gpt, make_run, run_main

from gptkit import chat_templates as templates
from gptkit.errors import ConfigError, GptkitError
from gptkit.inference.batcher import Batcher, Job, SamplingParams
from gptkit.inference.engine import Engine
from gptkit.inference.generate import ChatSession, generate
from gptkit.inference.sampling import SampleOptions
from gptkit.inference.speculative import (
    ModelDrafter,
    NgramDrafter,
    Rule,
    Speculator,
    load_speculator,
    verify_sampled,
)
from gptkit.model import GPT, ModelConfig
from gptkit.tokenizer import byte_tokenizer

# repeats itself: prompt lookup finds its n-grams
PROMPT = [3, 14, 15, 9, 2, 6, 3, 14, 15, 9, 2]
# a local layer (a window of 5) beside a global one, as test_batcher's rope-window
WINDOW = dict(position="rope", n_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False, sliding_window=5,
              layer_types=["local", "global"])  # fmt: skip


def drafters(model):
    # the model itself (every draft accepted), another model (few), one whose context is shorter than the
    # model's and than k (it sees the last tokens it has room for), prompt lookup
    other, short = greedy_gpt(24, seed=1, **WINDOW), greedy_gpt(3, seed=2)
    return [
        ModelDrafter(model, "self"),
        ModelDrafter(other, "other"),
        ModelDrafter(short, "short"),
        NgramDrafter(),
    ]


@pytest.mark.parametrize("fields", [{}, WINDOW], ids=["learned", "rope-window"])
def test_greedy_tokens_are_the_plain_decodes_for_every_drafter(fields):
    # max_seq_len 24 < prompt + 48 new: the window slides (overflow=slide), and the stop policy ends at it
    model = greedy_gpt(24, **fields)
    for overflow, n in (("slide", 48), ("stop", 40)):
        opts = SampleOptions(max_new_tokens=n, temperature=0, overflow=overflow, decode="eager")
        plain = generate(model, PROMPT, opts)
        assert len(set(plain.tokens[0])) > 3
        for drafter in drafters(model) if fields else [NgramDrafter(), ModelDrafter(model, "self")]:
            spec = Speculator(drafter, 4)
            g = generate(model, PROMPT, opts, speculate=spec)
            assert g.tokens == plain.tokens, (overflow, drafter.name)
            assert (g.stop_reasons, g.slides) == (plain.stop_reasons, plain.slides)
            s = g.speculative
            assert s["draft"] == drafter.name and s["target_forwards"] == spec.stats.forwards
            if drafter.name == "self":
                # the upper bound: every proposal accepted, up to k + 1 tokens a forward
                assert s["acceptance"] == 1.0 and s["tokens_per_forward"] > 3
    # an end-of-text token cuts the same place, and so does a stop string (streamed text included)
    eos = plain.tokens[0][7]
    opts = SampleOptions(max_new_tokens=40, temperature=0, eos_id=eos, decode="eager")
    want = generate(model, PROMPT, opts)
    got = generate(model, PROMPT, opts, speculate=Speculator(NgramDrafter(), 3))
    assert got.tokens == want.tokens and got.stop_reasons == want.stop_reasons == ["eos"]

    def text(ids):
        return "".join(chr(65 + i) for i in ids)

    stop = text(plain.tokens[0][9:11])
    opts = SampleOptions(max_new_tokens=40, temperature=0, stop=(stop,), decode="eager")
    streams = [[], []]
    want = generate(model, PROMPT, opts, decode=text, on_text=streams[0].append)
    spec = Speculator(ModelDrafter(model, "self"), 4)
    got = generate(model, PROMPT, opts, decode=text, on_text=streams[1].append, speculate=spec)
    assert (got.tokens, got.texts, got.stop_reasons) == (want.tokens, want.texts, ["stop"])
    assert "".join(streams[1]) == "".join(streams[0]) == want.texts[0]


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# the chi-square statistic's 0.999 quantile at 4 degrees of freedom (5 outcomes)
CHI2_4_999 = 18.47


def test_the_rejection_rule_draws_exactly_p_whatever_the_draft():
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.05, 0.1, 0.3, 0.5]])  # [2, V]: two positions
    q = torch.tensor([[0.05, 0.1, 0.15, 0.2, 0.5]])  # [1, V]: a poor draft
    gen = torch.Generator().manual_seed(0)
    rule = Rule(1.0, None, 1.0, gen)
    n = 4000
    first = torch.zeros(5)
    second = torch.zeros(5)
    point = torch.zeros(5)
    # the draft's proposals, drawn from q
    drafts = torch.multinomial(q[0], n, replacement=True, generator=gen).tolist()
    proposed = torch.bincount(torch.tensor(drafts), minlength=5).float()
    for d in drafts:
        # one draft: the first token, else the bonus token
        out = verify_sampled(p, q[:1], [d], rule)
        first[out[0]] += 1
        if len(out) == 2:
            second[out[1]] += 1
        # a deterministic draft (n-grams): always token 4, a point mass
        point[verify_sampled(p, None, [4], rule)[0]] += 1
    assert chi_square(first, p[0]) < CHI2_4_999
    assert chi_square(point, p[0]) < CHI2_4_999
    # the bonus token, after an accepted draft: p's next position
    assert chi_square(second, p[1]) < CHI2_4_999
    # the test can fail: the draft's own tokens are far from p
    assert chi_square(proposed, p[0]) > 10 * CHI2_4_999


def test_sampling_filters_apply_to_the_draft_and_the_model_alike():
    model = greedy_gpt(64, **WINDOW)
    plain = generate(model, PROMPT, SampleOptions(max_new_tokens=32, temperature=0, decode="eager"))
    # top_k=1 leaves one token: sampled speculation is then the greedy decode, whatever it draws
    opts = SampleOptions(max_new_tokens=32, temperature=1.0, top_k=1, seed=3, decode="eager")
    for drafter in drafters(model):
        assert generate(model, PROMPT, opts, speculate=Speculator(drafter, 4)).tokens == plain.tokens
    # seeded: the same draws again
    opts = SampleOptions(max_new_tokens=32, temperature=1.0, top_p=0.9, seed=3, decode="eager")
    runs = [generate(model, PROMPT, opts, speculate=Speculator(ModelDrafter(model, "self"), 4)) for _ in "ab"]
    assert runs[0].tokens == runs[1].tokens


def test_a_recurrent_state_and_a_batch_are_refused_in_one_line():
    hybrid = greedy_gpt(32, position="rope", **HYBRID_MODEL)
    with pytest.raises(GptkitError, match="recurrent state cannot be rewound"):
        generate(
            hybrid,
            PROMPT,
            SampleOptions(max_new_tokens=4, temperature=0),
            speculate=Speculator(NgramDrafter()),
        )
    with pytest.raises(GptkitError, match="the draft .* recurrent state"):
        ModelDrafter(hybrid, "hybrid")
    with pytest.raises(ConfigError, match="num_samples=2 must be 1"):
        opts = SampleOptions(max_new_tokens=4, num_samples=2)
        generate(greedy_gpt(32), PROMPT, opts, speculate=Speculator(NgramDrafter()))
    with pytest.raises(ConfigError, match="draft_k=0"):
        Speculator(NgramDrafter(), 0)


def test_chat_replies_are_the_plain_ones_turn_after_turn():
    torch.manual_seed(0)
    tok = byte_tokenizer([])
    t = templates.resolve_template("chatml", None)
    templates.add_special_tokens(tok, t)
    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(), max_seq_len=256, **WINDOW, n_layers=2, n_heads=4, d_model=32
    )
    model = GPT(cfg).eval()
    stop = (tok.token_to_id("<|im_end|>"),)

    def session(speculate=None):
        opts = SampleOptions(max_new_tokens=32, temperature=0.0)
        return ChatSession(model, tok, t, opts, system="Be brief.", stop_ids=stop, speculate=speculate)

    plain = session()
    spec = [session(Speculator(ModelDrafter(model, "self"), 4)), session(Speculator(NgramDrafter(), 4))]
    for msg in ("hello", "and again hello", "third"):
        want = plain.reply(msg)
        for s in spec:
            got = s.reply(msg)
            assert (got.tokens, got.text, got.stop_reason) == (want.tokens, want.text, want.stop_reason)
            assert got.fed_tokens == want.fed_tokens and got.speculative["target_forwards"] >= 1
    assert spec[0].messages == plain.messages


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run, a second one with the same tokenizer (other weights), a third with another tokenizer."""
    target = make_run(tmp_path_factory.mktemp("target"))
    draft = make_run(tmp_path_factory.mktemp("draft"), seed=1)
    other = make_run(tmp_path_factory.mktemp("other"), n_chars=3000)
    return target, draft[0], other[0]


def test_sample_draft_gives_the_plain_greedy_text_and_reports_acceptance(runs, capsys):
    (d, _, _), draft, other = runs
    prompt = "ROMEO: O, she doth teach the torches"
    common = (f"run={d}", f"prompt={prompt}", "greedy=true", "max_new_tokens=40", "device=cpu")
    code, plain, err = run_main(capsys, "sample", *common)
    assert code == 0, err
    code, out, err = run_main(capsys, "sample", *common, f"draft={draft}", "draft_k=3")
    assert code == 0 and out == plain, err
    last = err.strip().splitlines()[-1]
    assert "acceptance" in last and "tokens per target forward" in last and "draft_k=3" in last
    # a draft with another tokenizer: one line, exit 2, nothing printed
    code, out, err = run_main(capsys, "sample", *common, f"draft={other}")
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "byte for byte" in lines[0], err


def test_draft_mtp_and_draft_k_are_one_line_each(tmp_path):
    run = SimpleNamespace(model=greedy_gpt(32), dir=tmp_path)
    with pytest.raises(GptkitError, match="no MTP heads"):
        load_speculator("mtp", 4, run, "cpu", "fp32")
    with pytest.raises(ConfigError, match="draft_k=0 must be a positive integer"):
        load_speculator("ngram", 0, run, "cpu", "fp32")
    assert load_speculator(None, 4, run, "cpu", "fp32") is None
    assert load_speculator("ngram", None, run, "cpu", "fp32").k == 4


def run_batcher(model, jobs, speculate=None, max_batch=3):
    """Every (prompt, SamplingParams) through one Batcher -> per job (tokens, finish reason, log-probs)."""
    batcher = Batcher(model, max_batch=max_batch, speculate=speculate)
    got = [[[], None, []] for _ in jobs]

    def collect(i):
        def deliver(events):
            for e in events:
                got[i][0] += e.tokens
                got[i][2] += [round(lp[0], 4) for lp in e.logprobs]
                got[i][1] = e.finish or got[i][1]

        return deliver

    with torch.inference_mode():
        for i, (prompt, params) in enumerate(jobs):
            batcher.add(Job(prompt, params, collect(i)))
        while batcher.busy:
            batcher.step()
    assert batcher.active == 0
    return [tuple(map(tuple, (t, [f], lp))) for t, f, lp in got]


def test_the_batcher_with_a_draft_gives_each_request_the_plain_batchers_tokens():
    # serve's path: requests share the batch (4 for 3 slots: one waits), each sequence verified alone
    model = greedy_gpt(48, **WINDOW)
    g = torch.Generator().manual_seed(1)
    ps = [PROMPT] + [torch.randint(0, 61, (5 + 6 * i,), generator=g).tolist() for i in range(3)]
    eos = generate(model, ps[1], SampleOptions(max_new_tokens=12, temperature=0)).tokens[0][10]
    jobs = [
        (ps[0], SamplingParams(max_new_tokens=30, temperature=0.0)),
        (ps[1], SamplingParams(max_new_tokens=30, temperature=0.0, stop_ids=(eos,))),
        # no draft for a choice that asks for log-probs: its tokens and log-probs as before
        (ps[2], SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=2)),
        # past the context (48): ends by "context"
        (ps[3], SamplingParams(max_new_tokens=40, temperature=0.0)),
    ]
    plain = run_batcher(model, jobs)
    assert [r[1][0] for r in plain] == ["length", "eos", "length", "context"]
    for drafter in (ModelDrafter(model, "self"), NgramDrafter()):
        spec = Speculator(drafter, 4)
        assert run_batcher(model, jobs, spec) == plain, drafter.name
        if drafter.name == "self":
            assert spec.stats.acceptance == 1.0 and spec.stats.tokens_per_forward > 2
    # seeded sampling draws the same again; /health's figures come from the engine's load
    sampled = [(ps[0], SamplingParams(max_new_tokens=20, temperature=1.0, top_k=5, seed=7))]
    spec = Speculator(ModelDrafter(model, "self"), 4)
    assert run_batcher(model, sampled, spec) == run_batcher(model, sampled, spec)
    assert Engine(model, speculate=spec).load()["speculative"]["acceptance"] == spec.stats.acceptance > 0
