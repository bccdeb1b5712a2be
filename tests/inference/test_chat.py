"""Fine-tuning on chat data end to end and `gptkit chat`: the template's tokens added and the embedding grown,
the KV cache kept across turns (and the same replies without it), one answer per stdin line."""

import io
import json

import pytest
import torch
from conftest import TINY_LLAMA, run_main

from gptkit import chat_templates as templates
from gptkit.errors import GptkitError
from gptkit.inference.generate import ChatSession, generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig
from gptkit.runs import load_run, write_run_folder
from gptkit.tokenizer import byte_tokenizer

# 1 layer of 2 heads (1 of keys and values)
TINY = TINY_LLAMA | dict(n_layers=1, n_heads=2, n_kv_heads=1)
TINY |= dict(max_seq_len=96, d_ff=64, tie_embeddings=False, qk_norm="head")


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A base run without chat tokens, fine-tuned on chat data with the chatml template (2 steps)."""
    root = tmp_path_factory.mktemp("sft")
    torch.manual_seed(0)
    write_run_folder(
        root / "base",
        {"model": ModelConfig(vocab_size=256, **TINY).to_dict()},
        GPT(ModelConfig(vocab_size=256, **TINY)),
        byte_tokenizer([]),
    )
    data = root / "train.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
        for a in range(6)
        for b in range(6)
    ]
    # longer than a row: dropped, and counted
    rows.insert(3, {"prompt": "long " * 30, "response": "cut"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, data


def train_sft(capsys, root, data, name: str = "sft") -> str:
    """Fine-tune sft_run's base into runs/<name> (2 steps); its stderr."""
    code, _, err = run_main(
        capsys,
        "train",
        f"init_from={root / 'base'}",
        "data=chat",
        f"data.paths=[{data}]",
        "data.template=chatml",
        "trainer.batch_size=4",
        "trainer.max_steps=2",
        "trainer.val_every=2",
        "trainer.val_windows=2",
        "trainer.progress=false",
        "trainer.threads=1",
        f"runs_dir={root / 'runs'}",
        f"name={name}",
    )
    assert code in (0, None), err[-2000:]
    return err


def trained_sft(capsys, sft_run):
    """runs/sft of sft_run, trained here when this test runs first (pytest -n gives each worker its own)."""
    root, data = sft_run
    if not (root / "runs" / "sft").exists():
        train_sft(capsys, root, data)
    return root / "runs" / "sft"


def test_sft_adds_the_template_tokens_grows_the_embedding_and_reports_the_loss_share(sft_run, capsys):
    root, data = sft_run
    err = train_sft(capsys, root, data, name="sft-first")
    assert "added <|im_start|>, <|im_end|> to the tokenizer" in err
    assert "of the train targets carry loss (data.train_on=assistant)" in err
    assert "1 dropped (data.truncate=drop)" in err
    run = load_run(root / "runs" / "sft-first")
    assert run.model_cfg.vocab_size == 258 and run.tokenizer.token_to_id("<|im_end|>") == 257
    assert json.loads((run.dir / "chat.json").read_text())["name"] == "chatml"


def scripted_chat(capsys, monkeypatch, lines: str, *args):
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    return run_main(capsys, "chat", *args)


def test_chat_reads_one_message_a_line_and_prints_one_answer_each(sft_run, capsys, monkeypatch):
    run = trained_sft(capsys, sft_run)
    code, out, err = scripted_chat(
        capsys,
        monkeypatch,
        "1+2=\n\n3+4=\n/reset\n5+0=\n/exit\nnever read\n",
        f"run={run}",
        "greedy=true",
        "max_new_tokens=6",
        "threads=1",
        "--json",
    )
    assert code == 0, err
    answers = [json.loads(line) for line in out.splitlines()]
    assert [a["user"] for a in answers] == ["1+2=", "3+4=", "5+0="]
    # /reset starts over
    assert [a["turn"] for a in answers] == [1, 2, 1]
    first, second = answers[0], answers[1]
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["tokens"]
    new_tokens = second["prompt_tokens"] - first["prompt_tokens"]
    # turn 1 came from the cache
    assert second["fed_tokens"] < new_tokens + 4
    code, out, err = scripted_chat(
        capsys,
        monkeypatch,
        "1+2=\n3+4=\n",
        f"run={run}",
        "greedy=true",
        "max_new_tokens=6",
        "threads=1",
        # text: each answer and a newline
    )
    assert code == 0 and out == "".join(a["assistant"] + "\n" for a in answers[:2]) and "[turn 2:" in err


def test_a_scripted_chat_stops_at_a_message_too_long_for_the_context_with_one_error_line(
    sft_run, capsys, monkeypatch
):
    """Without a terminal a message the context cannot hold is one `error:` line and exit 2 (it was exit 0,
    the rest of stdin read on); the answers already printed stay, and the lines after it are not run."""
    run = trained_sft(capsys, sft_run)
    args = (f"run={run}", "greedy=true", "max_new_tokens=6", "threads=1")
    code, out, err = scripted_chat(capsys, monkeypatch, "1+2=\n" + "x" * 200 + "\n3+4=\n", *args, "--json")
    assert code == 2, err
    assert [json.loads(line)["user"] for line in out.splitlines()] == ["1+2="]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "exceeds the context of 96: shorten it" in errors[0], err
    assert "Traceback" not in err


def test_chat_refuses_a_template_whose_special_tokens_the_run_lacks(sft_run, capsys, monkeypatch):
    root, _ = sft_run
    sft = trained_sft(capsys, sft_run)
    code, _, err = scripted_chat(capsys, monkeypatch, "hi\n", f"run={root / 'base'}")
    assert code == 2 and "has no chat template" in err
    code, _, err = scripted_chat(capsys, monkeypatch, "hi\n", f"run={sft}", "template=llama3")
    assert code == 2 and "lacks the special tokens of the chat template llama3: <|begin_of_text|>" in err
    assert len(err.strip().splitlines()) == 1


def test_chat_s_default_max_new_tokens_fits_a_context_shorter_than_it(sft_run, capsys, monkeypatch):
    """The default (256) on a 96-token run: each answer is capped to what the context leaves, said once; the
    same number given by the user stays a one-line error."""
    run = trained_sft(capsys, sft_run)
    code, out, err = scripted_chat(
        capsys, monkeypatch, "1+2=\n3+4=\n", f"run={run}", "greedy=true", "threads=1", "--json"
    )
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: an answer")]
    assert notes == [
        "note: an answer gets at most what the 96-token context leaves after the conversation (the default "
        "max_new_tokens=256 does not fit; older turns are left out to keep 48 free); give max_new_tokens= to "
        "choose"
    ]
    answers = [json.loads(line) for line in out.splitlines()]
    assert len(answers) == 2 and all(a["prompt_tokens"] + a["tokens"] <= 96 for a in answers)
    code, out, err = scripted_chat(capsys, monkeypatch, "1+2=\n", f"run={run}", "max_new_tokens=256")
    assert code == 2 and out == ""
    assert err.strip() == (
        "error: max_new_tokens=256 leaves no room for the conversation in 96 tokens of context; lower it"
    )


def test_a_fitted_answer_ends_at_the_context_and_older_turns_make_room():
    torch.manual_seed(0)
    tok = byte_tokenizer([])
    t = templates.resolve_template("chatml", None)
    templates.add_special_tokens(tok, t)
    model = GPT(ModelConfig(vocab_size=tok.get_vocab_size(), **TINY)).eval()
    # no stop token: every answer runs as long as it may
    s = ChatSession(model, tok, t, SampleOptions(max_new_tokens=256, temperature=0.0), fit_answer=True)
    first = s.reply("hello")
    assert len(first.tokens) == 96 - first.prompt_tokens and first.stop_reason == "context"
    # the 96 tokens of turn 1 leave less than 48 free: turn 1 is left out
    second = s.reply("again")
    assert second.notes == ["the conversation outgrew the context: its oldest turn was left out"]
    assert second.prompt_tokens + len(second.tokens) == 96 and second.stop_reason == "context"
    # a message longer than the 48 kept free, shorter than the context: a shorter answer
    s.reset()
    long = s.reply("x" * 60)
    assert long.prompt_tokens > 48 and len(long.tokens) == 96 - long.prompt_tokens
    # one that fills the context: an error, and the conversation as it was
    s.reset()
    with pytest.raises(GptkitError, match="that exceeds the context of 96: shorten it"):
        s.reply("x" * 100)
    assert s.messages == []
    # the user's own max_new_tokens is kept free as asked
    s = ChatSession(model, tok, t, SampleOptions(max_new_tokens=40, temperature=0.0))
    assert len(s.reply("hello").tokens) == 40 and s.fit_note() is None


def session(reuse: bool, rope_scaling: dict | None = None) -> ChatSession:
    torch.manual_seed(0)
    tok = byte_tokenizer([])
    t = templates.resolve_template("chatml", None)
    templates.add_special_tokens(tok, t)
    fields = TINY | {"max_seq_len": 256, "rope_scaling": rope_scaling}
    model = GPT(ModelConfig(vocab_size=tok.get_vocab_size(), **fields)).eval()
    stop = (tok.token_to_id("<|im_end|>"),)
    return ChatSession(
        model,
        tok,
        t,
        SampleOptions(max_new_tokens=12, temperature=0.0),
        system="Be brief.",
        stop_ids=stop,
        reuse_cache=reuse,
    )


def test_kept_cache_runs_only_the_new_tokens_and_gives_the_same_replies():
    kept, fresh = session(True), session(False)
    replies = []
    for msg in ("hello", "and again", "third"):
        a, b = kept.reply(msg), fresh.reply(msg)
        assert a.tokens == b.tokens and a.text == b.text
        assert b.fed_tokens == b.prompt_tokens
        replies.append(a)
    # turn 3 ran only its own new tokens
    assert replies[2].fed_tokens < replies[2].prompt_tokens // 2
    # a new conversation starts from an empty cache, with the same first reply
    kept.reset()
    again = kept.reply("hello")
    assert again.fed_tokens == again.prompt_tokens and again.tokens == replies[0].tokens


def test_import_keeps_the_models_chat_template_for_chat(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")
    tok = byte_tokenizer([])
    t = templates.resolve_template("chatml", None)
    templates.add_special_tokens(tok, t)
    cfg = transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    hf_tok.chat_template = templates.CHATML
    hf_tok.save_pretrained(tmp_path / "hf")
    code, out, _ = run_main(capsys, "import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}")
    assert code == 0 and "chat template: kept in" in out
    saved = json.loads((tmp_path / "run" / "chat.json").read_text())
    assert saved["template"] == templates.CHATML and saved["variables"]["eos_token"] == "<|im_end|>"
    code, out, err = scripted_chat(
        capsys, monkeypatch, "hi\n", f"run={tmp_path / 'run'}", "max_new_tokens=3", "threads=1"
    )
    assert code == 0 and len(out.splitlines()) == 1, err


@pytest.mark.parametrize("where", ["reply", "prompt"])
def test_a_longrope_conversation_runs_every_key_again_when_it_outgrows_the_original_context(where):
    """LongRoPE (Phi-4-mini's): once the conversation outgrows the original context, the keys cached within
    it are stale; the kept cache is filled again (in a reply, or at the next prompt) and each reply is the
    greedy continuation computed without a cache."""
    plain = session(True)
    p1 = plain.reply("hello").prompt_tokens
    # the switch within turn 1's reply, or between turn 1 (p1 + 12 tokens) and turn 2's longer prompt
    original = p1 + 5 if where == "reply" else p1 + 12
    pairs = TINY["d_model"] // TINY["n_heads"] // 2
    scaling = {"type": "longrope", "factor": 4.0, "original_max_seq_len": original}
    s = session(True, scaling | {"short_factor": [1.0] * pairs, "long_factor": [3.0] * pairs})
    greedy = SampleOptions(max_new_tokens=12, temperature=0.0)
    crossed = False
    for msg in ("hello", "and again"):
        turn = s.reply(msg)
        prompt = s.cached[: turn.prompt_tokens]
        crossed |= turn.prompt_tokens <= original < turn.prompt_tokens + len(turn.tokens)
        want = generate(s.model, prompt, greedy, use_cache=False).tokens[0]
        assert turn.tokens == want[: len(turn.tokens)] and len(turn.tokens) > 3
    assert crossed == (where == "reply")


def tool_run(root):
    """A random tiny run with a Qwen2.5-style template with tool syntax (chatml's two special tokens)."""
    from conftest import TOOL_TEMPLATES

    torch.manual_seed(0)
    tok = byte_tokenizer(["<|endoftext|>"])
    text, variables, _ = TOOL_TEMPLATES["qwen2.5"]
    t = templates.ChatTemplate("qwen2.5", text, dict(variables), ["<|im_start|>", "<|im_end|>"])
    templates.add_special_tokens(tok, t)
    cfg = ModelConfig(**(TINY | dict(max_seq_len=1024)), vocab_size=tok.get_vocab_size())
    run = write_run_folder(
        root / "tools", {"tokenizer": {"eos_token": "<|endoftext|>"}}, GPT(cfg).eval(), tok
    )
    (run / templates.CHAT_FILE).write_text(t.to_json())
    return run, tok


def scripted_replies(monkeypatch, tok, replies: list[str]) -> list:
    """The model's replies, token by token (each ended by <|im_end|>), whatever its logits; and the
    conversations its prompts rendered."""
    ids = [
        i
        for r in replies
        for i in [*tok.encode(r, add_special_tokens=False).ids, tok.token_to_id("<|im_end|>")]
    ]
    it = iter(ids)
    monkeypatch.setattr("gptkit.inference.generate.sample_next", lambda *a, **k: torch.tensor([next(it)]))
    prompts = []
    real = templates.encode_conversation

    def spy(tokenizer, template, messages, *a, **k):
        prompts.append((list(messages), getattr(messages, "tools", None)))
        return real(tokenizer, template, messages, *a, **k)

    monkeypatch.setattr("gptkit.inference.generate.encode_conversation", spy)
    return prompts


def test_chat_runs_a_tool_modules_functions_and_feeds_their_results_back(tmp_path, capsys, monkeypatch):
    """tools=my_tools.py: announced before its code runs; the model's two calls (one tool raises) are
    shown, run, and their results (the error's text for the one that raised) rendered back as tool
    messages; the model's next reply is the answer. tools=file.json: the user types the result."""
    run, tok = tool_run(tmp_path)
    module = tmp_path / "my_tools.py"
    module.write_text(
        "import sys\n"
        "print('my_tools imported', file=sys.stderr)\n\n"
        "def get_weather(city: str, unit: str = 'C') -> str:\n"
        '    """The weather in a city, now."""\n'
        "    return f'18 {unit} in {city}'\n\n"
        "def boom(x: int):\n"
        '    """Fails."""\n'
        "    raise ValueError('no such x')\n"
    )
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    boom = '<tool_call>\n{"name": "boom", "arguments": {"x": 1}}\n</tool_call>'
    prompts = scripted_replies(monkeypatch, tok, [call + "\n" + boom, "It is 18 C."])
    code, out, err = scripted_chat(
        capsys, monkeypatch, "Weather?\n", f"run={run}", f"tools={module}", "threads=1", "--json"
    )
    assert code == 0, err
    assert err.index(f"chat tools= runs {module}") < err.index("my_tools imported")
    assert "tools: get_weather, boom" in err and 'tool call: get_weather({"city": "Paris"})' in err
    (answer,) = [json.loads(x) for x in out.splitlines()]
    assert answer["assistant"] == "It is 18 C."
    assert answer["tool_calls"] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}, "result": "18 C in Paris"},
        {"name": "boom", "arguments": {"x": 1}, "result": "error: ValueError: no such x"},
    ]
    # the second prompt: the tools (schemas from the signatures), the calls, their results; it outgrows
    # what the context leaves for a default answer, and the exchange stays whole (a user message and its
    # calls and results leave together, never the call without its results)
    msgs, tools = prompts[-1]
    assert [t["function"]["name"] for t in tools] == ["get_weather", "boom"]
    assert tools[0]["function"]["parameters"] == {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"],
    }
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert [m["content"] for m in msgs[2:]] == ["18 C in Paris", "error: ValueError: no such x"]
    # tools.json: the user answers the call
    specs = tmp_path / "tools.json"
    specs.write_text(json.dumps([WEATHER_SPEC]))
    prompts = scripted_replies(monkeypatch, tok, [call, "Sunny."])
    code, out, err = scripted_chat(
        capsys, monkeypatch, "Weather?\n21 C\n", f"run={run}", f"tools={specs}", "threads=1", "--json"
    )
    assert code == 0, err
    (answer,) = [json.loads(x) for x in out.splitlines()]
    assert answer["assistant"] == "Sunny." and answer["tool_calls"][0]["result"] == "21 C"
    assert prompts[-1][0][-1] == {
        "role": "tool",
        "tool_call_id": "call_0",
        "name": "get_weather",
        "content": "21 C",
    }


WEATHER_SPEC = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_bad_tools_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    run, _ = tool_run(tmp_path)
    bad_schema = tmp_path / "bad.json"
    bad_schema.write_text(json.dumps([{"type": "function", "function": {"name": "f", "parameters": []}}]))
    cases = [
        ([f"tools={tmp_path / 'nowhere.py'}"], "is not a file"),
        ([f"tools={bad_schema}"], "is not JSON Schema (a JSON object), got list"),
        ([f"tools={tmp_path / 'nowhere.json'}"], "no such file"),
        ([f"tools={bad_schema.with_suffix('.json')}", "template=chatml"], "writes no tool call"),
    ]
    specs = tmp_path / "ok.json"
    specs.write_text(json.dumps([WEATHER_SPEC]))
    cases[-1] = ([f"tools={specs}", "template=chatml"], "writes no tool call")
    for args, words in cases:
        code, out, err = scripted_chat(capsys, monkeypatch, "hi\n", f"run={run}", "threads=1", *args)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and words in err, (args, err)
