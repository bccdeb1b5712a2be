"""Multi-turn GRPO with an environment (grpo.environment=, docs/agentic.md): the environment contract (loaded
and announced, bad classes and schemas refused in one line), the turn loop (tools run, a raising tool ends its
episode with the error recorded, max_turns), a trajectory rendered as a data=chat record gives exactly the
ids and loss mask the rollout trains on (tool results masked), episodes are pure functions of their keys,
and a run with the shipped calculator trains, counts its episodes and `gptkit trace` shows each turn.
"""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_LLAMA, run_main, write_jsonl

from gptkit import chat_templates as templates
from gptkit.chat_formats.tools import Conversation
from gptkit.data.records import conversation
from gptkit.environments import calculator
from gptkit.errors import ConfigError
from gptkit.inference.environment import load_environment
from gptkit.inference.episodes import ANSWER, MAX_TURNS, TOOL_ERROR, EpisodeContext, run_episodes
from gptkit.inference.rollouts import RolloutOptions
from gptkit.model import GPT, ModelConfig
from gptkit.tokenizer import byte_tokenizer
from gptkit.training.objectives.grpo_episodes import EpisodeRollouts

ENV = "gptkit.environments.calculator:Calculator"
# the calculator's tools and one that raises
BOOM = """import sys
print('boom env imported', file=sys.stderr)
from gptkit.environments.calculator import Calculator

class Boom(Calculator):
    def explode(self, why: str) -> str:
        \"\"\"Always fails.\"\"\"
        raise RuntimeError(why)
"""


@pytest.fixture(scope="module")
def tiny():
    """A random tiny Llama, a byte tokenizer with the calculator template's special tokens."""
    torch.manual_seed(0)
    tok = byte_tokenizer(["<|endoftext|>"])
    template = templates.ChatTemplate("chatml-tools", calculator.TEMPLATE, {}, calculator.SPECIAL_TOKENS)
    templates.add_special_tokens(tok, template)
    cfg = TINY_LLAMA | dict(n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=256)
    model = GPT(ModelConfig(**cfg, vocab_size=tok.get_vocab_size())).eval()
    stop = (tok.token_to_id("<|im_end|>"),)
    return SimpleNamespace(tok=tok, template=template, model=model, stop=stop)


def context(tiny, spec=ENV, path=None):
    env = load_environment(f"{path}:{spec}" if path else spec, announce=False)
    return EpisodeContext(tiny.tok, tiny.template, tiny.template.call_syntax(), env)


def scripted(monkeypatch, tiny, replies: list[str]) -> None:
    """The model's replies, token by token (each ended by <|im_end|>), whatever its logits (one row)."""
    ids = [i for r in replies for i in [*tiny.tok.encode(r, add_special_tokens=False).ids, tiny.stop[0]]]
    it = iter(ids)
    monkeypatch.setattr("gptkit.inference.rollouts.sample_next", lambda *a, **k: torch.tensor([next(it)]))


def play(tiny, ctx, prompt="37 * 48 = ?", answer="1776", max_turns=3, keys=((1,),), new=96):
    opts = RolloutOptions(new, 1.0, None, 1.0, tiny.stop)
    rows = [([{"role": "user", "content": prompt}], {"prompt": prompt, "answer": answer})] * len(keys)
    return run_episodes(tiny.model, ctx, rows, [list(k) for k in keys], max_turns, opts, 256)


CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 48}}</tool_call>'


def test_an_environment_is_announced_and_bad_ones_are_one_line(tmp_path, capfd):
    f = tmp_path / "envs.py"
    f.write_text(
        BOOM + "\nclass NoScore:\n    def add(self, a: int) -> int:\n        return a\n"
        "\nclass BadSchema(Calculator):\n    TOOLS = [{'type': 'function', 'function': {'name': 'add', "
        "'parameters': {'type': 'object', 'properties': {'a': {'type': 'int'}}}}}]\n"
        "\nclass Nothing(Calculator):\n    TOOLS = []\n"
    )
    env = load_environment(f"{f}:Boom")
    err = capfd.readouterr().err
    assert err.index(f"grpo.environment runs {f} ({f}:Boom)") < err.index("boom env imported")
    assert env.names == ["add", "explode", "multiply"] and env.has_turn_reward
    assert env.specs[1]["function"]["parameters"]["required"] == ["why"]
    for spec, message in [
        (f"{f}:NoScore", "the class NoScore has no score method"),
        (f"{f}:BadSchema", "property 'a' has type 'int'"),
        (f"{f}:Nothing", "the class Nothing has no tools"),
        (f"{f}:Missing", f"{f} has no class Missing"),
        (f"{tmp_path / 'nowhere.py'}:Env", "is not a file"),
        ("calculator", "must be module:Class or file.py:Class"),
    ]:
        with pytest.raises(ConfigError) as exc:
            load_environment(spec, announce=False)
        assert message in str(exc.value) and "\n" not in str(exc.value), (spec, exc.value)


def test_a_trajectory_is_its_sft_records_ids_with_the_tool_results_masked(tiny, monkeypatch):
    """The call, its result in the context, the answer: the record data=chat reads back encodes to exactly
    the ids the rollout trains on, the same loss mask (the model's turns, not the tool's result), and the
    ids drawn are those ids where each turn stands."""
    scripted(monkeypatch, tiny, [CALL, "1776"])
    (e,) = play(tiny, context(tiny))[0]
    assert e.stop == ANSWER and e.error is None and len(e.turns) == 2
    assert e.turns[0].calls == [{"name": "multiply", "arguments": {"a": 37, "b": 48}}]
    assert e.turns[0].results == ["1776"] and e.score == 1.0 and e.reward == pytest.approx(1.1)
    # the trajectory as a data=chat record, read back as data=chat reads one (through JSON)
    record = json.loads(json.dumps(e.record()))
    s = dict(messages_field="messages", prompt_field="prompt", response_field=None, system_field="system")
    conv = conversation(record, "episode", s | {"tools_field": "tools"})
    assert isinstance(conv, Conversation) and conv.tools == calculator.TOOLS
    ids, mask = templates.encode_conversation(tiny.tok, tiny.template, conv, "episode")
    assert ids == e.ids and mask == e.mask
    for t in e.turns:
        assert ids[t.context : t.context + len(t.tokens)] == t.tokens and not t.retokenized
        assert all(mask[t.context : t.context + len(t.tokens)])
    text = tiny.tok.decode(ids, skip_special_tokens=False)
    result = text.index("<|im_start|>tool\n1776")
    # the mask: exactly the two turns' ids (and the template's newline after each), nothing of the tool's
    marked = [i for i, m in enumerate(mask) if m]
    turns = [i for t in e.turns for i in range(t.context, t.context + len(t.tokens) + 1)]
    assert marked == turns and not any(mask[result : result + len("<|im_start|>tool\n1776")])
    # GRPO's rows: x the ids, y the next id where the mask marks it
    x, y = EpisodeRollouts.rows(SimpleNamespace(seq_len=256), [[e]], 0)
    assert x[0, : len(ids) - 1].tolist() == ids[:-1]
    assert [i + 1 for i in (y[0] != -100).nonzero().flatten().tolist()] == marked


def test_a_raising_tool_ends_its_episode_with_the_error_and_max_turns_stops_the_calls(
    tiny, monkeypatch, tmp_path
):
    f = tmp_path / "boom.py"
    f.write_text(BOOM)
    scripted(monkeypatch, tiny, ['<tool_call>{"name": "explode", "arguments": {"why": "no"}}</tool_call>'])
    (e,) = play(tiny, context(tiny, "Boom", f))[0]
    assert e.stop == TOOL_ERROR and e.error == "error: RuntimeError: no" and e.score == 0.0
    assert e.messages[-1] == {
        "role": "tool",
        "tool_call_id": "call_0_0",
        "name": "explode",
        "content": e.error,
    }
    # max_turns=2: the second turn's call is not run
    scripted(monkeypatch, tiny, [CALL, CALL])
    (e,) = play(tiny, context(tiny), max_turns=2)[0]
    assert e.stop == MAX_TURNS and len(e.turns) == 2 and e.turns[1].results == []
    assert e.messages[-1]["role"] == "assistant" and e.reward == pytest.approx(0.1)
    # an unknown tool, a name that is not text (once a TypeError that stopped the run): text, the answer
    for name in ('"divide"', '{"a": 1}'):
        scripted(monkeypatch, tiny, ['<tool_call>{"name": %s, "arguments": {}}</tool_call>' % name])
        (e,) = play(tiny, context(tiny))[0]
        assert e.stop == ANSWER and e.turns[0].calls == [] and e.score == 0.0


def test_an_episode_is_a_pure_function_of_its_key(tiny):
    """The same key plays the same episode alone or beside others, in any order (a resumed step, another
    number of ranks); another key another one."""
    ctx = context(tiny)
    both = play(tiny, ctx, keys=((5, 6, 7),), new=12)[0]
    alone = play(tiny, ctx, keys=((6,),), new=12)[0][0]
    assert alone.ids == both[1].ids and alone.turns[0].tokens == both[1].turns[0].tokens
    assert both[0].ids != both[1].ids


@pytest.mark.long
def test_grpo_with_the_calculator_trains_counts_its_episodes_and_trace_shows_each_turn(tmp_path, capsys):
    """2 steps from a random start with the calculator (episodes of garbage: no call, score 0), its figures
    logged, the episodes written and shown by `gptkit trace`; a bad environment is one line, exit 2."""
    import gptkit

    rows = [{"prompt": f"{a} * 3 = ?", "answer": str(3 * a)} for a in range(10, 30)]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    files = calculator.write_data(tmp_path / "calc", 20, 0, 0)
    start = gptkit.train(
        [
            "model=llama-tiny",
            "model.n_layers=1",
            "model.d_model=32",
            "model.n_heads=2",
            "model.n_kv_heads=1",
            "model.d_ff=64",
            "model.max_seq_len=192",
            "tokenizer=byte",
            "data=chat",
            f"data.paths=[{files['sft']}]",
            f"data.template={files['chat']}",
            "trainer.max_steps=1",
            f"runs_dir={tmp_path}",
            "name=start",
            "trainer.accelerator=cpu",
            "trainer.progress=false",
        ]
    )
    base = [f"runs_dir={tmp_path}", "trainer.accelerator=cpu", "trainer.progress=false"]
    grpo = [
        *base,
        "objective=grpo",
        f"init_from={start.run_dir}",
        "data=prompts",
        f"data.paths=[{data}]",
        "grpo.group_size=2",
        "grpo.max_new_tokens=6",
        "trainer.batch_size=2",
        "trainer.seq_len=192",
    ]
    code, _, err = run_main(capsys, "train", *grpo, f"grpo.environment={tmp_path}/none.py:Env", "name=bad")
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: grpo.environment=")
    code, _, err = run_main(capsys, "train", *grpo, f"grpo.environment={ENV}", "grpo.max_turns=0", "name=b")
    assert code == 2 and "grpo.max_turns=0 must be an integer >= 1" in err
    run = tmp_path / "env"
    gptkit.train([*grpo, f"grpo.environment={ENV}", "trainer.max_steps=2", "trainer.val_every=2", "name=env"])
    metrics = (run / "metrics.csv").read_text()
    for key in (
        "train/rewards/score",
        "train/episode_turns",
        "train/turns_retokenized",
        "val/episode_errors",
    ):
        assert key in metrics
    episodes = [json.loads(line) for line in (run / "episodes" / "rank0.jsonl").read_text().splitlines()]
    assert sorted({e["micro_step"] for e in episodes}) == [0, 1] and len(episodes) == 8
    code, out, _ = run_main(capsys, "trace", f"run={run}", "step=2")
    assert code == 0 and "episode 0.0" in out and "turn 1:" in out
