"""A chat run exports chat-ready: the template in tokenizer_config.json and chat_template.jinja, generation
that stops at the end of a turn; transformers' apply_chat_template + generate() answers as `gptkit chat`
does; and an import of that folder keeps the template, which the next export gives back."""

import io
import json

import pytest
import torch
from conftest import TINY_LLAMA, run_main

from gptkit import chat_templates as templates
from gptkit.inference.generate import ChatSession
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig
from gptkit.runs import write_run_folder
from gptkit.tokenizer import byte_tokenizer

TINY = dict(TINY_LLAMA, max_seq_len=128, tie_embeddings=False, init_std=0.3)
MESSAGE = "What is 2+3?"


def ends_a_turn(tmp_path):
    """A chatml run whose greedy answer to MESSAGE ends with <|im_end|> after a few tokens: the end-of-turn
    row of the LM head is made a scaled copy of the row of a token the answer would emit."""
    torch.manual_seed(0)
    tok = byte_tokenizer(["<|endoftext|>"])
    t = templates.resolve_template("chatml", None)
    templates.add_special_tokens(tok, t)
    model = GPT(ModelConfig(vocab_size=tok.get_vocab_size(), **TINY)).eval()
    end = tok.token_to_id("<|im_end|>")
    stop = tuple(templates.reply_stop_ids(tok, t, "<|endoftext|>"))

    def reply():
        s = ChatSession(model, tok, t, SampleOptions(max_new_tokens=24, temperature=0.0), stop_ids=stop)
        return s.reply(MESSAGE)

    free = reply().tokens
    for k in range(3, len(free)):
        with torch.no_grad():
            model.lm_head.weight[end] = 1.5 * model.lm_head.weight[free[k]]
        r = reply()
        if r.stop_reason == "eos" and len(r.tokens) >= 3:
            break
    else:
        pytest.fail("no answer ending with <|im_end|> found")
    run = write_run_folder(tmp_path / "run", {"tokenizer": {"eos_token": "<|endoftext|>"}}, model, tok)
    (run / templates.CHAT_FILE).write_text(t.to_json())
    return run, tok


def test_export_is_chat_ready_and_transformers_answers_as_gptkit_chat(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")
    run, tok = ends_a_turn(tmp_path)
    end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    code, out, err = run_main(capsys, "export", f"run={run}", f"out={tmp_path / 'hf'}")
    assert code == 0, err
    assert "chat template chatml" in out and "stops at <|im_end|>, <|endoftext|>" in out
    hf = tmp_path / "hf"
    config = json.loads((hf / "tokenizer_config.json").read_text())
    assert config["chat_template"] == templates.CHATML == (hf / "chat_template.jinja").read_text()
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == [end, eot]

    # gptkit chat, greedy
    monkeypatch.setattr("sys.stdin", io.StringIO(MESSAGE + "\n"))
    code, out, err = run_main(capsys, "chat", f"run={run}", "greedy=true", "max_new_tokens=24", "--json")
    assert code == 0, err
    turn = json.loads(out.strip().splitlines()[-1])
    assert turn["stop_reason"] == "eos"

    hf_tok = transformers.AutoTokenizer.from_pretrained(hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    msgs = [{"role": "user", "content": MESSAGE}]
    ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    t = templates.template_in_folder(run)
    assert ids == templates.encode_conversation(tok, t, msgs, add_generation_prompt=True)[0]
    assert len(ids) == turn["prompt_tokens"]
    with torch.no_grad():
        got = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)[0, len(ids) :].tolist()
    # generate() stopped at the end of the turn (the end token is its last), gptkit chat's tokens before it
    assert got[-1] == end and len(got) == turn["tokens"] + 1
    assert hf_tok.decode(got[:-1]) == turn["assistant"]

    # import keeps the template; the next export gives it back
    code, out, err = run_main(capsys, "import", f"hf={hf}", f"out={tmp_path / 'back'}")
    assert code == 0 and "chat template: kept in" in out, err
    code, out, err = run_main(capsys, "export", f"run={tmp_path / 'back'}", f"out={tmp_path / 'hf2'}")
    assert code == 0, err
    again = json.loads((tmp_path / "hf2" / "tokenizer_config.json").read_text())
    assert again["chat_template"] == templates.CHATML
    assert json.loads((tmp_path / "hf2" / "generation_config.json").read_text())["eos_token_id"] == [end, eot]
