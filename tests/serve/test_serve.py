"""`gptkit serve` against real clients: one server (a subprocess on 127.0.0.1, a free port) for the module,
the official `openai` client (sync and streaming), raw HTTP (errors in OpenAI's shape, the key, the size
limit, a client that leaves), 16 concurrent clients whose greedy answers are all `sample`'s and `chat`'s,
and the chat page in a headless Chromium."""

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from conftest import HANG_S, TINY_LLAMA, TOOL_TEMPLATES, WEATHER, wait_for

from gptkit import chat_templates as templates
from gptkit.chat_formats.tools import Conversation, check_calls
from gptkit.inference.generate import ChatSession, encode_prompt, generate, special_token_ids
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig
from gptkit.runs import load_run, write_run_folder
from gptkit.tokenizer import byte_tokenizer

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

KEY = "test-key-35"
# a long context and a small model: a long answer takes long enough to leave in the middle of it
CONTEXT = 1024
MAX_BATCH = 4


def chat_run(root):
    """A chat-ready run: a byte tokenizer with <|endoftext|> and chatml's tokens, a random tiny model
    (init_std 0.3: greedy choices far from ties), a Qwen2.5-style template in chat.json (chatml's markup,
    and tool syntax: tools in the system turn, <tool_call> JSON replies, <tool_response> results)."""
    torch.manual_seed(0)
    tok = byte_tokenizer(["<|endoftext|>"])
    text, variables, _ = TOOL_TEMPLATES["qwen2.5"]
    # chatml's two special tokens (<tool_call> is text here, as Qwen2.5's tokenizer has it: not special)
    t = templates.ChatTemplate("qwen2.5", text, dict(variables), ["<|im_start|>", "<|im_end|>"])
    templates.add_special_tokens(tok, t)
    cfg = ModelConfig(**TINY_LLAMA, vocab_size=tok.get_vocab_size(), max_seq_len=CONTEXT, init_std=0.3)
    run = write_run_folder(
        root / "tiny-chat", {"tokenizer": {"eos_token": "<|endoftext|>"}}, GPT(cfg).eval(), tok
    )
    (run / templates.CHAT_FILE).write_text(t.to_json())
    return run


class Server:
    def __init__(self, proc, url, lines):
        self.proc, self.url, self.lines = proc, url, lines

    def client(self, **kw):
        return httpx.Client(
            base_url=self.url, timeout=HANG_S, headers={"Authorization": f"Bearer {KEY}"}, **kw
        )

    def health(self):
        return httpx.get(f"{self.url}/health", timeout=HANG_S).json()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run = chat_run(tmp_path_factory.mktemp("serve"))
    env = dict(os.environ, GPTKIT_API_KEY=KEY)
    env.pop("GPTKIT_VERB", None)
    args = [
        sys.executable,
        "-m",
        "gptkit",
        "serve",
        f"run={run}",
        "port=0",
        "threads=1",
        f"max_batch={MAX_BATCH}",
        "max_queue=64",
        "max_request_bytes=65536",
        "access_log=false",
        "allowed_hosts=[models.example]",
        "request_timeout=60",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    wait_for(lambda: any("listening on" in x for x in lines), proc, HANG_S)
    url = next(x for x in lines if "listening on" in x).split()[2]
    try:
        yield Server(proc, url, lines)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def ref(server):
    """The served run loaded here: what `gptkit sample` and `gptkit chat` answer greedily."""
    run_dir = server.lines[0].split()[1]
    r = load_run(run_dir)
    template = templates.template_in_folder(r.dir)
    stop = templates.reply_stop_ids(r.tokenizer, template, "<|endoftext|>")
    bos, eos = special_token_ids(r.tokenizer, r.config)

    class Ref:
        tokenizer = r.tokenizer
        model = r.model

        @staticmethod
        def chat_ids(message: str):
            msgs = [{"role": "user", "content": message}]
            return templates.encode_conversation(
                r.tokenizer, template, msgs, "x", add_generation_prompt=True
            )[0]

        @staticmethod
        def chat(message: str, n: int):
            s = ChatSession(
                r.model,
                r.tokenizer,
                template,
                SampleOptions(max_new_tokens=n, temperature=0.0),
                stop_ids=tuple(stop),
            )
            return s.reply(message)

        @staticmethod
        def sample(prompt: str, n: int, temperature: float = 0.0, seed=None):
            ids = encode_prompt(r.tokenizer, prompt, bos, eos)
            opts = SampleOptions(
                max_new_tokens=n, temperature=temperature, seed=seed, eos_id=eos, overflow="stop"
            )
            return ids, generate(r.model, ids, opts, decode=r.tokenizer.decode)

    return Ref


def finish(stop_reason: str) -> str:
    return {"eos": "stop", "stop": "stop", "length": "length"}[stop_reason]


def test_the_openai_client_chats_and_completes_as_chat_and_sample_do(server, ref):
    assert "chat template qwen2.5" in server.lines[0] and "try: curl" in "".join(server.lines)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=HANG_S)
    assert [m.id for m in client.models.list()] == ["tiny-chat"]
    assert client.models.retrieve("tiny-chat").owned_by == "gptkit"

    want = ref.chat("Hello there!", 40)
    r = client.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": "Hello there!"}],
        temperature=0,
        max_tokens=40,
    )
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == finish(want.stop_reason)
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.completion_tokens == len(want.tokens) + (want.stop_reason == "eos")

    chunks = list(
        client.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "Hello there!"}],
            temperature=0,
            max_completion_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish(
        want.stop_reason
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens

    ids, g = ref.sample("ROMEO:", 24)
    c = client.completions.create(model="tiny-chat", prompt="ROMEO:", temperature=0, max_tokens=24)
    assert c.choices[0].text == g.texts[0] and c.usage.prompt_tokens == len(ids)
    streamed = client.completions.create(
        model="tiny-chat", prompt="ROMEO:", temperature=0, max_tokens=24, stream=True
    )
    assert "".join(x.choices[0].text for x in streamed) == g.texts[0]
    # token ids as the prompt, top_k as an extension (top_k=1 is greedy at any temperature)
    c = client.completions.create(
        model="tiny-chat", prompt=ids, max_tokens=24, temperature=1.5, extra_body={"top_k": 1}
    )
    assert c.choices[0].text == g.texts[0]
    # n choices with a seed: reproducible, and different from each other
    kw = dict(model="tiny-chat", prompt="ROMEO:", max_tokens=16, temperature=1.0, n=3, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices] and len({x.text for x in a.choices}) > 1
    assert [x.index for x in a.choices] == [0, 1, 2]
    # a stop string ends the text before it
    stop = g.texts[0][5:7]
    c = client.completions.create(
        model="tiny-chat", prompt="ROMEO:", temperature=0, max_tokens=24, stop=[stop]
    )
    assert c.choices[0].text == g.texts[0][: g.texts[0].index(stop)] and c.choices[0].finish_reason == "stop"
    # the client's own errors
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def FN(parameters) -> dict:
    """A function tool `f` with these parameters."""
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def test_bad_requests_get_openais_error_shape_and_the_server_stays_up(server):
    long_prompt = "x" * (CONTEXT + 10)
    cases = [
        # (path, body or raw bytes, status, param, words in the message)
        ("/v1/completions", b'{"prompt": "x",', 400, None, "could not parse the JSON"),
        ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "must be an integer"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "must be a number"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "must be >= 1"),
        (
            "/v1/completions",
            {"prompt": "x", "colour": "blue"},
            400,
            "colour",
            "Unrecognized request argument",
        ),
        ("/v1/completions", {"prompt": ""}, 400, "prompt", "the prompt is empty"),
        (
            "/v1/completions",
            {"prompt": long_prompt},
            400,
            "prompt",
            f"maximum context length is {CONTEXT} tokens",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": CONTEXT}, 400, "max_tokens", "you requested"),
        ("/v1/completions", {"prompt": [99999]}, 400, "prompt", "token id 99999"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model", "does not exist"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "between 0 and 20"),
        ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, 400, "top_logprobs", "not supported"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            400,
            "top_logprobs",
            "between 0 and 20",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
            "needs logprobs: true",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}},
            },
            400,
            "response_format.json_schema.schema",
            'cannot compile response_format.json_schema.schema: Unsupported type "foo"',
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}},
            },
            400,
            "response_format.json_schema.schema",
            "Cannot find field 'x'",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            400,
            "response_format.type",
            "is not one of text, json_object, json_schema",
        ),
        ("/v1/completions", {"prompt": "x", "n": 99}, 400, "n", "between 1 and 4"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "must not be empty"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages[0].role",
            "is not one of",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "messages[0].content",
            "text only",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            400,
            "tools",
            "tool 1 must be an object {type: function, function",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [FN({"properties": {"a": {"type": "strin"}}})],
            },
            400,
            "tools",
            "is not JSON Schema: property 'a' has type 'strin'",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [FN({"type": "object", "properties": {"a": {"type": "string", "minLength": "3"}}})],
            },
            400,
            "tools[0].function.parameters",
            "(f) is not JSON Schema: '3' is not of type 'integer' (at properties/a/minLength)",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [FN({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})],
                "tool_choice": "required",
            },
            400,
            "tools",
            "the grammar engine cannot compile tools",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [FN({"type": "object"})],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            400,
            "tool_choice.function.name",
            "names the function 'g', which is not one of the tools (f)",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            400,
            "tool_choice",
            "needs tools: the request has none",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [FN(None)], "tool_choice": "often"},
            400,
            "tool_choice",
            'tool_choice="often" is not one of',
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [FN(None)],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            400,
            "tool_choice",
            "cannot both constrain",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "4"}]},
            400,
            "messages",
            "message 2 (tool) answers no call",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": long_prompt}]},
            400,
            "messages",
            "maximum context length",
        ),
        (
            "/v1/completions",
            b'{"prompt": "' + b"y" * 70000 + b'"}',
            413,
            None,
            "larger than this server's limit",
        ),
        ("/v1/nowhere", {}, 404, None, "Unknown request URL"),
        # numbers beyond what the engine takes: a seed torch's generators refuse failed the whole batch
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed", "between -9223372036854775808 and"),
        ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, 400, "seed", "out of range"),
        ("/v1/completions", {"prompt": "x", "seed": 2**64 - 1, "n": 2}, 400, "seed", "seed + n - 1"),
        ("/v1/completions", b'{"prompt": "x", "seed": 1e300}', 400, "seed", "(301 digits) is out of range"),
        ("/v1/completions", {"prompt": "x", "top_k": 2**63}, 400, "top_k", "out of range"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens", "out of range"),
        ("/v1/completions", {"prompt": "x", "stop": ["s" * 1001]}, 400, "stop", "longer than the 1,000"),
        # bodies the JSON parser or the tokenizer failed on (500s)
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None, "NaN is not a JSON number"),
        ("/v1/completions", b'{"prompt": "x", "top_p": Infinity}', 400, None, "Infinity is not"),
        ("/v1/completions", b'{"prompt": "x", "top_p": 1e999}', 400, None, "beyond a float's range"),
        ("/v1/completions", b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", 400, None, "digits"),
        ("/v1/completions", b"[" * 60_000, 400, None, "nested too deeply"),
        ("/v1/completions", b'{"a":' * 12_000, 400, None, "nested too deeply"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 70 + b"]" * 70 + b"}", 400, None, "more than 64 levels"),
        ("/v1/completions", b'"text"', 400, None, "JSON object"),
        ("/v1/completions", b"\xff\xfe", 400, None, "not UTF-8"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
            400,
            "messages[0].content",
            "lone UTF-16 surrogate",
        ),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\udc00"]}', 400, "stop[0]", "surrogate"),
        ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}', 400, None, "the body holds"),
        # a body a web page can send without asking the server first
        ("/v1/completions", ({"Content-Type": "text/plain"}, {"prompt": "x"}), 415, None, "application/json"),
        ("/v1/completions", ({"Content-Type": ""}, {"prompt": "x"}), 415, None, "no Content-Type"),
        (
            "/v1/completions",
            ({"Content-Type": "application/x-www-form-urlencoded"}, {"prompt": "x"}),
            415,
            None,
            "application/json",
        ),
        # a DNS-rebinding page: the browser sends its own domain as the Host
        ("/v1/completions", ({"Host": "attacker.example"}, {"prompt": "x"}), 421, None, "does not answer"),
    ]
    with server.client() as c:
        for path, body, status, param, words in cases:
            headers = {"Content-Type": "application/json"}
            if isinstance(body, tuple):
                extra, body = body
                headers.update(extra)
                body = json.dumps(body).encode()
            if isinstance(body, bytes):
                r = c.post(path, content=body, headers={k: v for k, v in headers.items() if v})
            else:
                r = c.post(path, json=body)
            assert r.status_code == status, (path, body if isinstance(body, dict) else body[:40], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
            assert words in err["message"], err
            assert "Traceback" not in r.text
        assert c.get("/v1/completions").status_code == 405
        # JSON with its charset, and the names this server is reached by, pass
        for host in ("localhost", "127.0.0.1", "[::1]", "models.example"):
            port = server.url.rsplit(":", 1)[1]
            r = c.post(
                "/v1/completions",
                content=json.dumps({"prompt": "x", "max_tokens": 2}).encode(),
                headers={"Content-Type": "Application/JSON; charset=UTF-8", "Host": f"{host}:{port}"},
            )
            assert r.status_code == 200, (host, r.text)
        # the key
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
            r = httpx.post(
                f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers, timeout=HANG_S
            )
            assert r.status_code == 401 and r.json()["error"]["code"] in (
                "missing_api_key",
                "invalid_api_key",
            )
        # the health check and the page need no key; the server is still up
        assert server.health()["status"] == "ok"
        assert "gptkit chat" in httpx.get(server.url + "/", timeout=HANG_S).text


def test_message_text_that_spells_a_control_token_stays_text(server, ref):
    spelled = "say <|im_end|> now"
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": spelled}], "max_tokens": 4, "temperature": 0},
        )
    want = ref.chat(spelled, 4)
    assert r.json()["usage"]["prompt_tokens"] == want.prompt_tokens
    assert r.json()["choices"][0]["message"]["content"] == want.text
    # one token more than the bytes' count would be, had the spelling become the control id
    im_end = ref.tokenizer.token_to_id("<|im_end|>")
    ids, _ = templates.encode_conversation(
        ref.tokenizer,
        templates.template_in_folder(load_run(server.lines[0].split()[1]).dir),
        [{"role": "user", "content": spelled}],
        add_generation_prompt=True,
    )
    assert ids.count(im_end) == 1 and len(ids) == want.prompt_tokens


def test_a_client_that_leaves_frees_its_slot(server):
    before = server.health()["ended"]["cancelled"]
    body = {
        "prompt": "A long answer:",
        "max_tokens": CONTEXT - 20,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break
    # the connection is closed: the engine ends the choice as cancelled and frees the slot
    ok = lambda: (h := server.health())["active"] == 0 and h["ended"]["cancelled"] == before + 1  # noqa: E731
    wait_for(ok, server.proc, HANG_S)


def test_sixteen_concurrent_clients_each_get_samples_and_chats_greedy_answer(server, ref):
    jobs = []
    for i in range(48):
        n = 8 + (i * 5) % 17
        if i % 2:
            text = f"Tell me about {i} things"
            want = ref.chat(text, n).text
            body = (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0},
            )
        else:
            text = f"{i}: ROMEO, KING{'!' * (i % 7)}"
            want = ref.sample(text, n)[1].texts[0]
            body = (
                "/v1/completions",
                {"prompt": text, "max_tokens": n, "temperature": 0, "stream": i % 4 == 0},
            )
        jobs.append((body, want))
    answers: dict[int, str] = {}
    steps_before = server.health()["steps"]

    def client(k):
        with server.client() as c:
            for i in range(k, len(jobs), 16):
                (path, body), _ = jobs[i]
                if body.get("stream"):
                    with c.stream("POST", path, json=body) as r:
                        assert r.status_code == 200
                        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
                    answers[i] = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
                else:
                    r = c.post(path, json=body)
                    assert r.status_code == 200, r.text
                    choice = r.json()["choices"][0]
                    answers[i] = choice.get("text", choice.get("message", {}).get("content"))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert not any(t.is_alive() for t in threads)
    # nothing dropped, every greedy answer is sample's (completions) or chat's (chat)
    assert sorted(answers) == list(range(48))
    wrong = [i for i, (_, want) in enumerate(jobs) if answers[i] != want]
    assert wrong == []
    h = server.health()
    # the requests shared batches of up to max_batch, the rest queued
    assert h["max_batch"] == MAX_BATCH and h["mean_batch"] > 1 and h["steps"] > steps_before
    assert h["active"] == 0 and h["waiting"] == 0
    # paged KV memory: every block back; the chats' shared template prefix was served from the prefix cache
    kv = h["kv_cache"]
    assert kv["free"] == kv["blocks"] and 0 < kv["prefix_hit_rate"] < 1 and kv["prefix_hit_tokens"] > 0
    assert any("KV cache: paged" in line for line in server.lines)
    # the banner says whose matmuls decode (the test model's small layers: torch's at least in part)
    assert any("decode matmuls: " in line and "torch's" in line for line in server.lines)


def test_logprobs_are_the_models_log_softmax_in_openais_shapes(server, ref):
    """Chat and completions, greedy and sampled, streamed and not, four requests sharing the batch: each
    token's logprob and top_logprobs are the log-softmax of the model's logits (temperature 1) over the
    prompt and the tokens sampled, as a forward of the model computes them; the openai client reads them."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=HANG_S)
    chat = dict(model="tiny-chat", max_tokens=12)
    comp = dict(model="tiny-chat", prompt="ROMEO:", max_tokens=12)
    requests = {
        "chat greedy": lambda: client.chat.completions.create(
            messages=[{"role": "user", "content": "Hi"}], temperature=0, logprobs=True, top_logprobs=3, **chat
        ),
        "chat sampled stream": lambda: list(
            client.chat.completions.create(
                messages=[{"role": "user", "content": "Yo"}],
                temperature=1.3,
                seed=5,
                logprobs=True,
                top_logprobs=2,
                stream=True,
                **chat,
            )
        ),
        "comp greedy stream": lambda: list(
            client.completions.create(temperature=0, logprobs=3, stream=True, **comp)
        ),
        "comp sampled": lambda: client.completions.create(temperature=0.7, seed=11, n=2, logprobs=0, **comp),
    }
    got: dict = {}
    threads = [threading.Thread(target=lambda k=k, f=f: got.update({k: f()})) for k, f in requests.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert sorted(got) == sorted(requests)

    def model_logprobs(prompt: list[int], new: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = ref.model(torch.tensor([prompt + new])).logits[0]  # [T, V]
        return torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : len(prompt) - 1 + len(new)]  # [N, V]

    tok = ref.tokenizer
    # chat: each token named by its text and its bytes (this tokenizer: the id is the byte; a special token's
    # bytes are its text's)

    def tid(e) -> int:
        return e.bytes[0] if len(e.bytes) == 1 else tok.token_to_id(e.token)

    whole = got["chat greedy"].choices[0]
    streamed = [c.choices[0] for c in got["chat sampled stream"] if c.choices]
    for prompt, content, text, k in (
        (ref.chat_ids("Hi"), whole.logprobs.content, whole.message.content, 3),
        (
            ref.chat_ids("Yo"),
            [e for c in streamed if c.logprobs for e in c.logprobs.content],
            "".join(c.delta.content or "" for c in streamed),
            2,
        ),
    ):
        ids = [e.bytes[0] for e in content]
        assert all(len(e.bytes) == 1 and e.token == tok.decode([i]) for e, i in zip(content, ids))
        assert tok.decode(ids) == text and len(ids) >= 3
        want = model_logprobs(prompt, ids)
        for pos, e in enumerate(content):
            assert e.logprob == pytest.approx(want[pos, ids[pos]].item(), abs=1e-4)
            top_v, top_i = want[pos].topk(k)
            assert [tid(t) for t in e.top_logprobs] == top_i.tolist()
            assert [t.logprob for t in e.top_logprobs] == pytest.approx(top_v.tolist(), abs=1e-4)
    # greedy: the top choice is the token chosen
    assert all(e.token == e.top_logprobs[0].token for e in whole.logprobs.content)

    # completions: the ids are what `gptkit sample` draws with the same seed
    parts = [c.choices[0] for c in got["comp greedy stream"]]
    streamed_lp = [c.logprobs for c in parts if c.logprobs]
    cases = ((ref.sample("ROMEO:", 12), "".join(c.text for c in parts), streamed_lp, 3),) + tuple(
        # n=2: choice i draws with seed 11 + i, both from the one prefill
        (
            ref.sample("ROMEO:", 12, temperature=0.7, seed=11 + i),
            got["comp sampled"].choices[i].text,
            [got["comp sampled"].choices[i].logprobs],
            0,
        )
        for i in range(2)
    )
    for (prompt, g), text, lps, k in cases:
        ids = g.tokens[0]
        assert text == g.texts[0] and len(ids) >= 3
        tokens = [t for lp in lps for t in lp.tokens]
        values = [v for lp in lps for v in lp.token_logprobs]
        tops = [t for lp in lps for t in lp.top_logprobs]
        offsets = [o for lp in lps for o in lp.text_offset]
        assert tokens == [tok.decode([i]) for i in ids]
        assert offsets == [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
        want = model_logprobs(prompt, ids)
        assert values == pytest.approx([want[p, i].item() for p, i in enumerate(ids)], abs=1e-4)
        for pos, top in enumerate(tops):
            # the k most likely and the sampled token (tokens that decode alike share a key)
            assert 1 <= len(top) <= k + 1 and top[tokens[pos]] == pytest.approx(values[pos], abs=1e-4)
            if k:
                assert max(top.values()) == pytest.approx(want[pos].max().item(), abs=1e-4)
    # no logprobs asked: null, as before
    r = client.completions.create(temperature=0, **comp)
    assert r.choices[0].logprobs is None


def json_errors(value, schema) -> list[str]:
    """What in value the (small) schema forbids: type, enum, range, required and extra properties."""
    kind = schema.get("type")
    if "enum" in schema:
        return [] if value in schema["enum"] else [f"{value!r} not in {schema['enum']}"]
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{value!r} is not an object"]
        props = schema.get("properties", {})
        errs = [f"missing {k}" for k in schema.get("required", []) if k not in value]
        errs += [
            f"extra {k}" for k in value if k not in props and schema.get("additionalProperties") is False
        ]
        return errs + [e for k, v in value.items() if k in props for e in json_errors(v, props[k])]
    if kind == "array":
        if not isinstance(value, list) or not schema.get("minItems", 0) <= len(value) <= schema["maxItems"]:
            return [f"{value!r} is not an array of the right length"]
        return [e for v in value for e in json_errors(v, schema["items"])]
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok and schema["minimum"] <= value <= schema["maximum"] else [f"{value!r} out of range"]
    if kind == "boolean":
        return [] if isinstance(value, bool) else [f"{value!r} is not a boolean"]
    if kind == "string":
        return (
            [] if isinstance(value, str) and len(value) <= schema["maxLength"] else [f"{value!r} bad string"]
        )
    return [f"unknown schema {schema}"]


def test_response_format_forces_json_that_parses_against_the_schema(server):
    """A random model writes bytes, yet with a grammar every answer that ends by itself is JSON valid against
    the schema (greedy and sampled, streamed, n choices next to a request without a format); the request
    beside them is the same as without them."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["name", "age", "ok", "tags"],
        "additionalProperties": False,
    }
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=HANG_S)
    msgs = [{"role": "user", "content": "Describe someone as JSON"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    plain = dict(model="tiny-chat", messages=msgs, temperature=0, max_tokens=24)
    alone = client.chat.completions.create(**plain).choices[0].message.content
    got: dict = {}
    calls = {
        "greedy": lambda: client.chat.completions.create(
            model="tiny-chat", messages=msgs, temperature=0, max_tokens=200, response_format=fmt
        ),
        "sampled": lambda: client.chat.completions.create(
            model="tiny-chat",
            messages=msgs,
            temperature=1.0,
            seed=3,
            n=2,
            max_tokens=200,
            response_format=fmt,
        ),
        "object": lambda: list(
            client.chat.completions.create(
                model="tiny-chat",
                messages=msgs,
                temperature=1.0,
                seed=1,
                n=3,
                max_tokens=200,
                stream=True,
                response_format={"type": "json_object"},
            )
        ),
        "plain": lambda: client.chat.completions.create(**plain),
    }
    threads = [threading.Thread(target=lambda k=k, f=f: got.update({k: f()})) for k, f in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert sorted(got) == sorted(calls)
    answers = [c for k in ("greedy", "sampled") for c in got[k].choices]
    for c in answers:
        assert c.finish_reason == "stop", c
        assert json_errors(json.loads(c.message.content), schema) == [], c.message.content
    assert len({c.message.content for c in answers}) > 1
    # json_object: any object (a random model's may run to max_tokens; one that ends is whole)
    chunks = [c.choices[0] for c in got["object"] if c.choices]
    texts = ["".join(c.delta.content or "" for c in chunks if c.index == i) for i in range(3)]
    ends = [next(c.finish_reason for c in chunks if c.index == i and c.finish_reason) for i in range(3)]
    assert all(t.startswith("{") for t in texts) and "stop" in ends
    assert all(isinstance(json.loads(t), dict) for t, e in zip(texts, ends) if e == "stop")
    # the batch-mate without a format: its answer alone, which is not JSON
    assert got["plain"].choices[0].message.content == alone
    with pytest.raises(json.JSONDecodeError):
        json.loads(alone)
    # the client's own helper: the schema of a pydantic class, the answer parsed into one
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=6)
        age: int = Field(ge=0, le=120)
        ok: bool

    parsed = client.chat.completions.parse(
        model="tiny-chat", messages=msgs, temperature=0, max_tokens=200, response_format=Person
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)


# tools whose arguments a random model can finish (bounded strings, enums, integers)
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}


def streamed_calls(chunks) -> tuple[str, list[dict], list[str]]:
    """(content, calls {id, name, arguments} by index, finish reasons) of choice 0's stream, as the
    openai client's users reassemble tool_calls deltas."""
    content, calls, ends = "", {}, []
    for c in chunks:
        for ch in c.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            if ch.finish_reason:
                ends.append(ch.finish_reason)
    return content, [calls[k] for k in sorted(calls)], ends


def test_the_openai_client_runs_a_tool_loop_and_forced_calls_always_parse(server, ref):
    """A random model never calls a tool by itself; tool_choice required or named forces a call through the
    grammar, which always parses into tool_calls valid against the tool's schema (greedy, sampled n=2,
    streamed); the client then sends the tool's result and gets a final answer, rendered as the template
    renders that conversation. auto and none answer text."""
    import jsonschema

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=HANG_S)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model="tiny-chat", messages=msgs, tools=[CITY, ADD], tool_choice=named, temperature=0, max_tokens=200
    )
    c = first.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), CITY["function"]["parameters"])
    # streamed: the same call (greedy), as deltas
    content, calls, ends = streamed_calls(
        client.chat.completions.create(
            model="tiny-chat",
            messages=msgs,
            tools=[CITY, ADD],
            tool_choice=named,
            temperature=0,
            max_tokens=200,
            stream=True,
        )
    )
    assert content == "" and ends == ["tool_calls"]
    assert [(x["name"], x["arguments"]) for x in calls] == [("get_weather", call.function.arguments)]
    assert calls[0]["id"].startswith("call_")
    # required: any of the tools, each sampled choice a valid call
    sampled = client.chat.completions.create(
        model="tiny-chat",
        messages=msgs,
        tools=[CITY, ADD],
        tool_choice="required",
        temperature=1.0,
        seed=5,
        n=2,
        max_tokens=200,
    )
    for ch in sampled.choices:
        assert ch.finish_reason == "tool_calls", ch
        (x,) = ch.message.tool_calls
        tool = {"get_weather": CITY, "add": ADD}[x.function.name]
        jsonschema.validate(json.loads(x.function.arguments), tool["function"]["parameters"])
    # the loop: the call and its result sent back, a final answer
    result = {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}
    loop = [*msgs, c.message.model_dump(exclude_none=True), result]
    # the client's message object sent back as it is (its null fields and refusal too): the same prompt
    same = client.chat.completions.create(
        model="tiny-chat", messages=[*msgs, c.message, result], tools=[CITY, ADD], temperature=0, max_tokens=8
    )
    final = client.chat.completions.create(
        model="tiny-chat", messages=loop, tools=[CITY, ADD], temperature=0, max_tokens=8
    )
    assert (
        final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.tool_calls is None
    )
    assert isinstance(final.choices[0].message.content, str)
    # the prompt the server ran: the template's render of that conversation with the tools (the call's
    # arguments as an object, its result in a <tool_response>)
    conv = Conversation(
        check_calls([*msgs, {**loop[1], "content": ""}, result], "x"),
        [CITY, ADD],
    )
    ids = templates.encode_conversation(
        ref.tokenizer,
        templates.template_in_folder(load_run(server.lines[0].split()[1]).dir),
        conv,
        "x",
        add_generation_prompt=True,
    )[0]
    assert final.usage.prompt_tokens == same.usage.prompt_tokens == len(ids)
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in ref.tokenizer.decode(
        ids, skip_special_tokens=False
    )
    # auto: the random model's text; none: text too
    for choice in ("auto", "none"):
        r = client.chat.completions.create(
            model="tiny-chat", messages=msgs, tools=[CITY], tool_choice=choice, temperature=0, max_tokens=8
        )
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("kind", list(TOOL_TEMPLATES))
def test_replies_read_back_into_calls_in_each_syntax_and_streamed_alike(kind):
    """The reader of each template family's call syntax (learned from the template): a call, text then
    calls, several calls; botched ones (bad JSON, an unknown function, arguments against the schema, text
    after the call, a reply cut by max_tokens) are text with finish_reason stop. Streamed in pieces of 1
    and 5 characters, the deltas reassemble into the same content and calls."""
    from types import SimpleNamespace

    from gptkit.serve.endpoints.chat_completions import ChatReply
    from gptkit.serve.tool_calls import ToolCalls

    text, variables, special = TOOL_TEMPLATES[kind]
    syntax = templates.ChatTemplate(kind, text, dict(variables), list(special)).call_syntax()
    assert syntax is not None
    call = syntax.call_text("get_weather", {"city": "Paris", "unit": "C"})
    add = syntax.call_text("add", {"a": 1, "b": 2})
    good = {
        "call": (call, None, [("get_weather", {"city": "Paris", "unit": "C"})]),
        "compact": (
            call.replace('", "', '","').replace(": ", ":"),
            None,
            [("get_weather", {"city": "Paris", "unit": "C"})],
        ),
    }
    botched = [
        call.replace('"Paris"', "Paris"),
        call.replace("get_weather", "get_wether"),
        call.replace('"C"', '"K"'),
        call + " and more",
        "Just text, {no call}.",
    ]
    if syntax.prefix.strip():
        good["text then calls"] = (
            "Let me check.\n" + call + "\n" + add,
            "Let me check.",
            [("get_weather", {"city": "Paris", "unit": "C"}), ("add", {"a": 1, "b": 2})],
        )
    else:
        # Llama 3.1: a reply is one call, from its start
        botched += ["Let me check. " + call, call + add]
    tools = [WEATHER, ADD]

    def whole(t: str, reason: str = "stop") -> dict:
        reply = ChatReply("m", calls=ToolCalls(syntax, tools, None, True))
        return reply.choice(0, t, reason, [])

    def streamed(t: str, size: int, reason: str = "eos"):
        reply = ChatReply("m", calls=ToolCalls(syntax, tools, None, True))
        chunks = [x for i in range(0, len(t), size) for x in reply.stream(0, t[i : i + size], [])]
        chunks += reply.ending(0, reason)
        return streamed_calls(
            [SimpleNamespace(choices=[_ns(ch) for ch in chunk["choices"]]) for chunk in chunks]
        )

    for name, (t, content, calls) in good.items():
        w = whole(t)
        assert w["finish_reason"] == "tool_calls" and w["message"]["content"] == content, (name, w)
        got = [
            (x["function"]["name"], json.loads(x["function"]["arguments"]))
            for x in w["message"]["tool_calls"]
        ]
        assert got == calls, name
        for size in (1, 5):
            s_content, s_calls, ends = streamed(t, size)
            assert (s_content or None) == content and ends == ["tool_calls"], (name, size)
            assert [(x["name"], json.loads(x["arguments"])) for x in s_calls] == calls
    for t in botched:
        w = whole(t)
        assert (
            w["finish_reason"] == "stop" and w["message"]["content"] == t and "tool_calls" not in w["message"]
        )
        for size in (1, 5):
            assert streamed(t, size) == (t, [], ["stop"]), t
    # a tokenizer with the markers as special tokens (which decoding drops): the reply is read with them
    from gptkit.serve.served import Served
    from gptkit.serve.tokens import TokenTexts

    tok = byte_tokenizer(["<|endoftext|>"])
    t = templates.ChatTemplate(kind, text, dict(variables), list(special))
    templates.add_special_tokens(tok, t)
    lead = "Hi " if syntax.prefix.strip() else ""
    body = json.dumps({syntax.name_key: "add", syntax.args_key: {"a": 1, "b": 2}})
    ids = templates.encode_text(tok, lead)
    for piece in (syntax.prefix.strip(), body, syntax.suffix.strip()):
        ids += (
            [tok.token_to_id(piece)]
            if tok.token_to_id(piece) is not None
            else templates.encode_text(tok, piece)
        )
    fake = SimpleNamespace(tokens=TokenTexts(tok, tok.get_vocab_size()), tokenizer=tok)
    fake.chat_text = lambda i: t.reply_text(tok, i)
    read = Served.call_text(fake, syntax)(ids)
    if syntax.prefix.strip():
        assert tok.decode(ids) == lead + body
    assert whole(read)["message"]["tool_calls"][0]["function"]["name"] == "add" and read.startswith(lead)
    # cut by max_tokens: text, as it stands
    w = whole(call, "length")
    assert w["finish_reason"] == "length" and w["message"]["content"] == call
    assert streamed(call, 3, "length") == (call, [], ["length"])


def _ns(choice: dict):
    """A stream chunk's choice as the openai client's objects read (attributes)."""
    from types import SimpleNamespace

    calls = choice["delta"].get("tool_calls")
    delta = SimpleNamespace(
        content=choice["delta"].get("content"),
        tool_calls=[
            SimpleNamespace(
                index=c["index"],
                id=c.get("id"),
                function=SimpleNamespace(
                    name=c["function"].get("name"), arguments=c["function"].get("arguments")
                ),
            )
            for c in calls
        ]
        if calls
        else None,
    )
    return SimpleNamespace(delta=delta, finish_reason=choice["finish_reason"])


def test_response_format_without_the_grammar_engine_is_a_400_naming_the_install(monkeypatch):
    from gptkit.serve import grammar
    from gptkit.serve.protocol import ApiError

    class Served:
        grammar = None

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ApiError) as err:
        grammar.response_format(Served(), {"type": "json_object"})
    assert err.value.status == 400 and err.value.param == "response_format"
    assert 'pip install -e ".[serve]"' in err.value.message
    # text needs no engine
    assert grammar.response_format(Served(), {"type": "text"}) is None


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def test_the_chat_page_streams_an_answer_in_a_browser(server, ref, tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("no Chromium binary on this machine (apt-get install chromium); .ci/run installs it")
    sync_api = pytest.importorskip("playwright.sync_api")
    want = ref.chat("Hi page", 30)
    flags = [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]
    shot = tmp_path / "chat-page.png"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=binary, headless=True, args=flags)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 640})
            page.set_default_timeout(HANG_S * 1000)
            page.goto(server.url + "/")
            # a locator's wait, not wait_for_function: a string predicate that is false at first is polled
            # through eval, which the page's CSP (no 'unsafe-eval') refuses (a slow first fetch under load)
            page.locator("#model", has_text="tiny-chat").wait_for()
            page.fill("#api-key", KEY)
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "30")
            page.fill("#message", "Hi page")
            page.press("#message", "Enter")
            page.wait_for_selector(".assistant[data-state=done]")
            answer = page.eval_on_selector(".assistant .text", "e => e.textContent")
            errors = page.locator(".error").all_inner_texts()
            finished = page.get_attribute(".assistant", "data-finish")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert answer == want.text
    assert finished == finish(want.stop_reason)
    assert shot.stat().st_size > 1000
    print(f"chat page screenshot: {shot}")


def test_a_full_queue_answers_429(tmp_path):
    """In process (the app over httpx's ASGI transport): one slot, no queue, the slot busy."""
    import asyncio

    from gptkit.inference.batcher import SamplingParams
    from gptkit.serve.app import build_app
    from gptkit.serve.served import load_served

    served = load_served(str(chat_run(tmp_path)), device="cpu", max_batch=1, max_queue=0)
    served.engine.start()
    try:
        busy = served.engine.submit([1, 2, 3], SamplingParams(max_new_tokens=CONTEXT - 10, temperature=0.0))
        assert next(iter(busy)).finish is None

        async def call():
            transport = httpx.ASGITransport(app=build_app(served))
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
                return await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})

        r = asyncio.run(call())
        busy.cancel()
    finally:
        served.engine.stop()
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error" and "max_queue=0" in r.json()["error"]["message"]


def test_paging_options_that_cannot_run_are_one_line(tmp_path):
    """serve's paging keys: refused in one line, exit 2 (the context's divisor once the run is read)."""
    from gptkit.errors import ConfigError
    from gptkit.inference.block_pool import Paging
    from gptkit.serve.served import load_served

    run = chat_run(tmp_path)
    with pytest.raises(ConfigError, match=f"^block_size=7 must divide the context of {CONTEXT} tokens$"):
        load_served(str(run), device="cpu", paging=Paging(block_size=7))
    env = dict(os.environ)
    env.pop("GPTKIT_VERB", None)
    # before torch is imported
    cmd = [sys.executable, "-m", "gptkit", "serve", f"run={run}", "max_step_tokens=2", "kv_blocks=0"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=HANG_S)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: kv_blocks=0 must be an integer >= 1"), r.stderr
    r = subprocess.run(
        cmd[:-2] + ["prefix_cache=maybe"], capture_output=True, text=True, env=env, timeout=HANG_S
    )
    assert r.returncode == 2 and r.stderr == "error: prefix_cache=maybe must be true or false\n", r.stderr


def test_an_endpoint_added_to_the_table_is_guarded_and_run_like_the_others(tmp_path):
    """In process: two endpoints app.py has never seen, a GET answering JSON and a POST asking the engine for
    a Generation in a reply shape of its own, get the API key, the body checks and errors in OpenAI's shape,
    and the engine's answer whole and streamed, as /v1/completions gets them."""
    import asyncio
    import json

    from gptkit.serve.app import build_app
    from gptkit.serve.endpoints import ENDPOINTS, Endpoint, Reply
    from gptkit.serve.protocol import bad, check_unknown, sampling
    from gptkit.serve.served import load_served

    class Echo(Reply):
        prefix, object, chunk_object = "echo", "echo.completion", "echo.chunk"

        def choice(self, index, text, reason, logprobs):
            return {"index": index, "said": text, "why": reason}

        def delta(self, index, text, reason, logprobs):
            return self.choice(index, text or "", reason, logprobs)

    class Say(Endpoint):
        path = "/v1/say"

        def answer(self, body, path_params):
            check_unknown(body, {"word", "max_tokens", "temperature", "stream"})
            if not isinstance(body.get("word"), str) or not body["word"]:
                raise bad("word must be a non-empty string", "word", "invalid_value")
            s = sampling(body, 1)
            return self.generation([self.served.completion_ids(body["word"])], s, s.max_tokens, (), Echo)

    class Count(Endpoint):
        path = "/v1/count/{word}"
        method = "GET"

        def answer(self, body, path_params):
            return {"word": path_params["word"], "ids": len(self.served.completion_ids(path_params["word"]))}

    served = load_served(str(chat_run(tmp_path)), device="cpu", max_batch=2)
    key = {"Authorization": "Bearer k"}
    say = {"word": "hello", "max_tokens": 4, "temperature": 0}
    served.engine.start()
    try:

        async def call():
            app = build_app(served, api_key="k", endpoints=(*ENDPOINTS, Say, Count))
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
            ) as c:
                ref = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
                return [
                    await c.post("/v1/completions", json=ref, headers=key),
                    await c.post("/v1/say", json=say, headers=key),
                    await c.post("/v1/say", json={**say, "stream": True}, headers=key),
                    await c.get("/v1/count/hello", headers=key),
                    await c.post("/v1/say", json=say),
                    await c.get("/v1/count/hello"),
                    await c.post(
                        "/v1/say", content=json.dumps(say), headers={**key, "content-type": "text/plain"}
                    ),
                    await c.post("/v1/say", json={**say, "word": 3}, headers=key),
                    await c.post("/v1/say", json={**say, "n": 2}, headers=key),
                    await c.get("/v1/say", headers=key),
                ]

        ref, whole, stream, count, *bad_ones = asyncio.run(call())
    finally:
        served.engine.stop()
    text = ref.json()["choices"][0]["text"]
    assert ref.status_code == 200 and len(text) > 0
    assert whole.status_code == 200, whole.text
    assert whole.json()["object"] == "echo.completion" and whole.json()["id"].startswith("echo-")
    assert whole.json()["choices"] == [{"index": 0, "said": text, "why": "length"}]
    assert whole.json()["usage"] == ref.json()["usage"]
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"echo.chunk"}
    assert (
        "".join(c["choices"][0]["said"] for c in chunks) == text
        and chunks[-1]["choices"][0]["why"] == "length"
    )
    assert count.json() == {"word": "hello", "ids": 5}
    answers = [(r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) for r in bad_ones]
    assert answers == [
        (401, "missing_api_key", None),
        (401, "missing_api_key", None),
        (415, "unsupported_media_type", None),
        (400, "invalid_value", "word"),
        (400, "unknown_parameter", "n"),
        (405, None, None),
    ]


def test_a_request_that_fails_in_the_engine_fails_alone_and_at_once(tmp_path, monkeypatch, ref):
    """In process: a poisoned request's sampler raises at its 3rd token while a seeded neighbour (held at its
    5th token until the poisoned one has its answer) and a greedy streaming one share its batch. The
    poisoned one gets its 500 while the neighbour is still mid-way; both neighbours then get their whole,
    correct answers."""
    import asyncio
    import time

    import gptkit.inference.batcher as batcher_module
    from gptkit.serve.app import build_app
    from gptkit.serve.served import load_served

    served = load_served(str(chat_run(tmp_path)), device="cpu", max_batch=4)
    real_sample = batcher_module.sample_next
    calls = {13: 0, 17: 0}
    answered = threading.Event()
    held: list[bool] = []

    def sample(logits, temperature, top_k, top_p, generator):
        if top_k in calls:
            calls[top_k] += 1
            # the neighbour's first token waits until the other two requests are queued: one batch
            if top_k == 17 and calls[17] == 1:
                deadline = time.monotonic() + HANG_S
                while len(served.engine._inbox) < 2 and time.monotonic() < deadline:
                    time.sleep(0.005)
            if top_k == 17 and calls[17] == 5:
                held.append(answered.wait(HANG_S))
            if top_k == 13 and calls[13] == 3:
                raise ValueError("injected sampler failure")
        return real_sample(logits, temperature, top_k, top_p, generator)

    monkeypatch.setattr(batcher_module, "sample_next", sample)
    seeded = {"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0.8, "top_k": 17, "seed": 5}
    poisoned = {"prompt": "abc", "max_tokens": 12, "temperature": 0.8, "top_k": 13, "seed": 1}
    greedy = {"prompt": "KING:", "max_tokens": 12, "temperature": 0, "stream": True}
    served.engine.start()
    try:

        async def call():
            transport = httpx.ASGITransport(app=build_app(served))
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:

                async def post(body):
                    return await c.post("/v1/completions", json=body, timeout=HANG_S)

                async def poisoned_post():
                    r = await post(poisoned)
                    answered.set()
                    return r

                a = asyncio.ensure_future(post(seeded))
                await asyncio.sleep(0.05)
                got = await asyncio.gather(a, poisoned_post(), post(greedy))
                # the seeded request again, alone, nothing failing beside it
                return got + [await post(seeded)]

        r_seeded, r_poisoned, r_greedy, r_alone = asyncio.run(call())
    finally:
        served.engine.stop()
    assert r_poisoned.status_code == 500, r_poisoned.text
    err = r_poisoned.json()["error"]
    assert err["code"] == "generation_failed" and "ValueError: injected sampler failure" in err["message"]
    # the poisoned request had its answer while the neighbour waited at its 5th token (of 12)
    assert held == [True]
    assert r_seeded.status_code == 200 and r_alone.status_code == 200
    assert r_seeded.json()["choices"] == r_alone.json()["choices"]
    assert r_seeded.json()["usage"]["completion_tokens"] == 12
    chunks = [json.loads(x[6:]) for x in r_greedy.text.splitlines() if x.startswith("data: {")]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == ref.sample("KING:", 12)[1].texts[0]
    assert served.engine.load()["ended"]["error"] == 1


LIMITED = """
import sys
from gptkit.serve.served import load_served
from gptkit.serve.server import serve
serve(load_served(sys.argv[1], device="cpu", max_batch=2), port=0, request_timeout=1.0,
      allowed_hosts=("models.example",))
"""


def test_slow_clients_are_cut_off_other_hosts_refused_and_the_access_log_is_on_stderr(tmp_path):
    """serve() itself, keyless, with request_timeout=1 and allowed_hosts=[models.example]: a connection
    sending its headers slowly is closed, a body arriving slowly gets 408; the Host rules; uvicorn's access
    log on stderr, stdout the banner only."""
    import socket

    run = chat_run(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", LIMITED, str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        wait_for(lambda: any("listening on" in x for x in lines), proc, HANG_S)
        url = next(x for x in lines if "listening on" in x).split()[2]
        port = int(url.rsplit(":", 1)[1])

        def raw(data: bytes) -> bytes:
            """Send data, then read until the server closes the connection (a guard of 60 s: 60 times the
            deadline; socket.timeout fails the test)."""
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                s.sendall(data)
                got = b""
                while chunk := s.recv(65536):
                    got += chunk
                return got

        # headers that never end: closed without an answer (without the deadline: open until the guard)
        assert raw(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: 1") == b""
        # a body that never ends: 408 in OpenAI's shape
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\nConnection: close\r\n\r\n"
        )
        answer = raw(head + b'{"prompt": ')
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"code":"request_timeout"' in answer
        # the names it answers to
        for host, status in (("models.example", 200), ("127.0.0.1", 200), ("evil.example", 421)):
            r = httpx.get(f"{url}/v1/models", headers={"Host": host}, timeout=HANG_S)
            assert r.status_code == status, (host, r.text)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=HANG_S)
        assert r.status_code == 200
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert '"POST /v1/completions HTTP/1.1" 200' in err and '"GET /v1/models HTTP/1.1" 421' in err
    assert not any("HTTP/1.1" in x for x in lines), lines


def test_any_value_of_any_field_is_answered_never_a_500(tmp_path):
    """In process: every field either endpoint knows (and a message's role, content, name) set to values of
    every JSON type and the edges of the integers: each answer is a 200 or an OpenAI-shaped 4xx."""
    import asyncio

    from gptkit.serve.app import build_app
    from gptkit.serve.endpoints.chat_completions import CHAT_FIELDS
    from gptkit.serve.endpoints.completions import COMPLETION_FIELDS
    from gptkit.serve.served import load_served

    served = load_served(str(chat_run(tmp_path)), device="cpu", max_batch=4)
    values = [None, True, 0, 1, -1, 1.5, 2**63, -(2**63) - 1, 1e308, "s", "", [], [1], ["a"], [[1]], {}]
    values += [{"a": 1}, [None], [{}]]
    chat_base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    bodies = []
    for path, fields, base in (
        ("/v1/completions", COMPLETION_FIELDS, {"prompt": "x", "max_tokens": 1}),
        ("/v1/chat/completions", CHAT_FIELDS, chat_base),
    ):
        for field in sorted(fields):
            for v in values:
                if field in ("max_tokens", "max_completion_tokens") and v in (1, 1.5):
                    continue
                bodies.append((path, {**base, field: v}))
    for key in ("role", "content", "name"):
        for v in values:
            bodies.append(("/v1/chat/completions", {**chat_base, "messages": [{"role": "user", key: v}]}))
    served.engine.start()
    try:

        async def call():
            transport = httpx.ASGITransport(app=build_app(served))
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
                return [await c.post(path, json=body, timeout=HANG_S) for path, body in bodies]

        answers = asyncio.run(call())
    finally:
        served.engine.stop()
    wrong = []
    for (path, body), r in zip(bodies, answers):
        if r.status_code == 200:
            ok = "generation failed" not in r.text
        else:
            ok = 400 <= r.status_code < 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        if not ok:
            wrong.append((path, body, r.status_code, r.text[:200]))
    assert wrong == []
    assert (
        sum(r.status_code == 200 for r in answers) > 50 and sum(r.status_code == 400 for r in answers) > 500
    )
