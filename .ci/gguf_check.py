#!/usr/bin/env python3
"""`gptkit export format=gguf` against llama.cpp itself (issue 56 item 1): llama-cpp-python (a CPU build)
loads each file, tokenizes as gptkit does, and decodes greedily as `gptkit sample greedy=true` does.
.ci/gguf calls it (after installing llama-cpp-python); by hand: `python .ci/gguf_check.py` in a venv with
gptkit[gguf-check].

For each family (a random tiny model of its layout: 2 layers, d_model 64, init_std 0.3, so that its greedy
choices are not near ties), tokenizer (gptkit's char vocabulary, a byte-level BPE trained here, the
256-byte vocabulary) and type (f32, f16, q8_0):

  tok      llama.cpp's tokens of a text == gptkit's (the BPE and byte vocabularies: a mixed-script text,
           Latin, Cyrillic, CJK, an emoji, digits, tabs and newlines; the char vocabulary: a text of its
           corpus's characters, as gptkit refuses any other)
  greedy   llama.cpp's 32 greedy tokens after a prompt against `gptkit sample greedy=true
           max_new_tokens=32 eos=false` (reported: how many equal, where they first differ)
  forced   the same 32 tokens fed to both (teacher forcing): at every position llama.cpp's argmax is
           gptkit's token, or the two tokens' gap in gptkit's logits is within twice the largest |difference|
           of the two sides' logits over those positions (a near tie, counted: a free-running decode parts
           there, as Mixtral's router did once in f32). Asked of f32 and f16, with those differences within
           F16_TOL (the prompt's last logits) and FORCED_TOL (every position's) of the spread; reported for
           q8_0
  logits   the largest |difference| of the prompt's last-position logits (llama.cpp's vs gptkit's f32), and
           for q8_0 against Q8_TOL

  chat     a run with a chat template (chatml), two turns of `gptkit chat greedy=true`: each turn's prompt as
           llama-cpp-python renders the file's own template, tokenized, == gptkit's ids; gptkit's answers
           forced through llama.cpp as above (f32). (llama-cpp-python's create_chat_completion swaps a
           template it recognises, chatml, for its own formatter, which adds an empty system turn: pass
           chat_format="chat_template.default" to use the file's)

A family llama.cpp cannot read prints its one-line refusal. Exit 1 when a row that should hold does not.
Arguments, if any, pick families by name, and `chat` the chat row (`python .ci/gguf_check.py Mixtral chat`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N_NEW = 32
# llama.cpp's logits within this fraction of the spread (max - min) of gptkit's fp32 logits: q8_0, fp16
Q8_TOL = 0.05
F16_TOL = 0.005
FORCED_TOL = 0.01
MIXED = "Hello, wörld! Привет, мир. 你好世界 🙂 x=42;\n\tend  of   line\n"
PROMPT = "First Citizen:\nWhat say"
LAYOUT = dict(position="rope", mlp="swiglu", norm="rmsnorm", bias=False, n_kv_heads=2)
GEMMA = dict(
    position="rope",
    mlp="geglu",
    norm="rmsnorm_unit_offset",
    norm_placement="sandwich",
    scale_embeddings=True,
    bias=False,
    n_kv_heads=2,
)
FAMILIES = {
    "Llama": LAYOUT,
    # Llama 3.1's RoPE scaling (the rope_freqs tensor), an original context of 32 so that it acts
    "Llama 3.1": LAYOUT
    | dict(
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_seq_len": 32,
        }
    ),
    "Qwen2": LAYOUT | dict(qkv_bias=True),
    "Qwen3": LAYOUT | dict(qk_norm="head"),
    "Mistral": LAYOUT | dict(sliding_window=128),
    "OLMo-2": LAYOUT | dict(qk_norm="full", norm_placement="post"),
    "GPT-2": dict(position="learned"),
    "Gemma 2": GEMMA
    | dict(attn_softcap=50.0, logit_softcap=30.0, sliding_window=32, layer_types=["local", "global"]),
    "Gemma 3": GEMMA | dict(qk_norm="head", rope_theta=10000.0),
    "Mixtral": LAYOUT | dict(moe={"n_experts": 4, "top_k": 2, "d_expert": 64}),
    "Qwen3-MoE": LAYOUT | dict(qk_norm="head", moe={"n_experts": 4, "top_k": 2, "d_expert": 64}),
    # refused: llama.cpp's qwen3moe renormalizes the top-k weights
    "Qwen3-MoE unnormalized": LAYOUT
    | dict(qk_norm="head", moe={"n_experts": 4, "top_k": 2, "d_expert": 64, "norm_topk_prob": False}),
    # refused: llama.cpp has no Phi-3 layout gptkit writes
    "Phi-3": LAYOUT | dict(rotary_dim=8),
}
TOKENIZERS = ("char", "bpe", "byte")
TYPES = ("fp32", "fp16", "q8_0")


def make_run(root: Path, family: str, kind: str, text: str, specials: tuple | list = ()) -> Path:
    import torch

    from gptkit.model import GPT, ModelConfig
    from gptkit.runs import write_run_folder
    from gptkit.tokenizer import build_tokenizer

    corpus = root / "corpus.txt"
    corpus.write_text(text)
    tok_cfg = {"kind": kind, "special_tokens": ["<|endoftext|>", *specials], "eos_token": "<|endoftext|>"}
    tok_cfg |= {"unk_token": None} if kind == "char" else {}
    tok_cfg |= {"vocab_size": 400, "min_frequency": 2} if kind == "bpe" else {}
    tok = build_tokenizer(tok_cfg, texts=lambda: [text], progress=False)
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        max_seq_len=128,
        n_layers=2,
        n_heads=4,
        d_model=64,
        init_std=0.3,
        **FAMILIES[family],
    )
    config = {"data": {"kind": "files", "paths": [str(corpus)], "val_fraction": 0.1}, "tokenizer": tok_cfg}
    return write_run_folder(root / "run", config, GPT(cfg).eval(), tok)


def gptkit(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gptkit", *args], capture_output=True, text=True, input=stdin
    )


CHAT = ["Hello there, who are you?", "And what say you now?"]


def chat_row(root: Path, text: str) -> tuple[str, bool]:
    """gptkit chat against llama.cpp on one run with the chatml template: (row, held). Each turn's prompt as
    llama-cpp-python renders the file's own template (its Jinja2ChatFormatter over the metadata's
    tokenizer.chat_template, as create_chat_completion with chat_format="chat_template.default") and
    tokenizes it, against gptkit's ids; then gptkit's greedy answer fed to llama.cpp, checked as the
    families' forced rows are."""
    import numpy as np
    import torch
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from gptkit.chat_templates import CHAT_FILE, encode_conversation, resolve_template
    from gptkit.runs import load_model, load_tokenizer

    d = root / "chat"
    d.mkdir()
    # the char vocabulary: every answer is text that round-trips (a byte-level BPE answer may end inside a
    # character, which the two sides show differently)
    run = make_run(d, "Llama", "char", text, ["<|im_start|>", "<|im_end|>"])
    template = resolve_template("chatml", None)
    (run / CHAT_FILE).write_text(template.to_json())
    common = ("greedy=true", "max_new_tokens=24", "format=json", "threads=1", "device=cpu")
    r = gptkit("chat", f"run={run}", *common, stdin="\n".join(CHAT) + "\n")
    if r.returncode:
        return f"gptkit chat failed: {r.stderr.strip()[-300:]}", False
    answers = [json.loads(line)["assistant"] for line in r.stdout.splitlines()]
    r = gptkit("export", f"run={run}", f"out={d / 'gguf'}", "format=gguf", "dtype=fp32")
    if r.returncode:
        return f"export failed: {r.stderr.strip()[-300:]}", False
    llm = Llama(str(d / "gguf" / "model.gguf"), n_ctx=256, verbose=False, n_threads=2, logits_all=True)
    formatter = Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], eos_token="", bos_token="")
    tok = load_tokenizer(run)
    *_, model = load_model(run)
    messages, same_prompt, forced, ties, bad, worst = [], 0, 0, 0, 0, 0.0
    for user, answer in zip(CHAT, answers):
        messages.append({"role": "user", "content": user})
        ids, _ = encode_conversation(tok, template, messages, add_generation_prompt=True)
        prompt = formatter(messages=messages).prompt
        same_prompt += llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
        want = tok.encode(answer, add_special_tokens=False).ids
        llm.reset()
        llm.eval(ids + want)
        lo = len(ids) - 1
        theirs = np.array([llm.scores[i] for i in range(lo, lo + len(want))])
        with torch.no_grad():
            mine = model(torch.tensor([ids + want]))
            mine = (mine[0] if isinstance(mine, tuple) else mine)[0, lo : lo + len(want)].float().numpy()
        diff = float(np.abs(theirs - mine).max())
        worst = max(worst, diff / float((mine.max(-1) - mine.min(-1)).min()))
        # each position: llama.cpp's choice against gptkit's own on the same tokens (a near tie: gptkit's
        # logits of the two within twice the two sides' largest difference)
        for i in range(len(want)):
            a, m = int(np.argmax(theirs[i])), int(np.argmax(mine[i]))
            near = a != m and mine[i][m] - mine[i][a] <= 2 * diff
            forced += a == m
            ties += near
            bad += a != m and not near
        messages.append({"role": "assistant", "content": answer})
    n = sum(len(tok.encode(a, add_special_tokens=False).ids) for a in answers)
    held = same_prompt == len(CHAT) and bad == 0 and worst <= FORCED_TOL
    return (
        f"prompt ids equal {same_prompt}/{len(CHAT)} turns; gptkit chat's answers forced {forced}/{n}"
        f"{f' + {ties} near ties' if ties else ''}{f' + {bad} apart' if bad else ''} "
        f"(max|dlogit| {worst:.1e} of the spread)  {'ok' if held else 'FAILED'}",
        held,
    )


def without_extra_buffers() -> None:
    """llama.cpp's extra weight layouts (repacked and AMX: llama_model_params.use_extra_bufts) off for every
    Llama this script loads, as `gptkit bench sample`'s llamacpp part has them (conf/bench/sample.yaml): a
    llama-cpp-python built natively with AMX_INT8 (a wheel pip cached from such a build) dies of SIGILL on a
    Q8_0 decode on this VM, while what is checked here is the exported file, not llama.cpp's layouts."""
    import llama_cpp.llama as high

    low = high.llama_cpp
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params


def main() -> int:
    import numpy as np
    import torch
    from llama_cpp import Llama

    from gptkit.data.sources import shakespeare_text
    from gptkit.runs import load_model, load_tokenizer

    without_extra_buffers()

    started = time.time()
    text = shakespeare_text()[:20_000]
    rows, failed = [], 0
    root = Path(tempfile.mkdtemp(prefix="gguf-check-"))
    for family in [f for f in FAMILIES if not sys.argv[1:] or f in sys.argv[1:]]:
        for kind in {"Llama": TOKENIZERS, "GPT-2": ("char", "bpe")}.get(family, ("bpe",)):
            d = root / f"{family.replace(' ', '')}-{kind}"
            d.mkdir()
            run = make_run(d, family, kind, text)
            tok = load_tokenizer(run)
            sample = gptkit(
                "sample",
                f"run={run}",
                f"prompt={PROMPT}",
                "greedy=true",
                f"max_new_tokens={N_NEW}",
                "eos=false",
                "format=json",
                "threads=1",
                "device=cpu",
            )
            if sample.returncode:
                print(f"{family} {kind}: gptkit sample failed: {sample.stderr.strip()[-300:]}")
                failed += 1
                continue
            want = json.loads(sample.stdout.splitlines()[-1])["tokens"]
            _, _, _, _, model = load_model(run)
            ids = tok.encode(PROMPT, add_special_tokens=False).ids
            with torch.no_grad():
                ref = model(torch.tensor([ids]))
                ref = (ref[0] if isinstance(ref, tuple) else ref)[0, -1].float().numpy()
            check = MIXED if kind != "char" else text[1000:1400]
            for dtype in TYPES:
                out = d / f"gguf-{dtype}"
                r = gptkit("export", f"run={run}", f"out={out}", "format=gguf", f"dtype={dtype}")
                if r.returncode:
                    rows.append((family, kind, dtype, "refused: " + r.stderr.strip().splitlines()[-1][7:]))
                    continue
                try:
                    llm = Llama(
                        str(out / "model.gguf"), n_ctx=128, logits_all=True, verbose=False, n_threads=2
                    )
                except ValueError as exc:
                    rows.append((family, kind, dtype, f"llama.cpp does not load it ({exc}) FAILED"))
                    failed += 1
                    continue
                tok_ok = (
                    llm.tokenize(check.encode(), add_bos=False, special=False)
                    == tok.encode(check, add_special_tokens=False).ids
                )
                llm.reset()
                llm.eval(llm.tokenize(PROMPT.encode(), add_bos=False, special=False))
                diff = float(np.abs(np.array(llm.scores[llm.n_tokens - 1]) - ref).max())
                got = []
                for _ in range(N_NEW):
                    t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                    got.append(t)
                    llm.eval([t])
                same = sum(a == b for a, b in zip(got, want))
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
                spread = float(ref.max() - ref.min())
                # teacher forcing: gptkit's tokens into both, each position's choice compared
                llm.reset()
                llm.eval(ids + want)
                lo = len(ids) - 1
                theirs = np.array([llm.scores[i] for i in range(lo, lo + N_NEW)])
                with torch.no_grad():
                    mine = model(torch.tensor([ids + want]))
                    mine = (mine[0] if isinstance(mine, tuple) else mine)[0, lo : lo + N_NEW].float().numpy()
                tf_diff = float(np.abs(theirs - mine).max())
                ties = bad = 0
                for i in range(N_NEW):
                    # want is gptkit's greedy decode, so its own argmax at each position
                    a, m = int(np.argmax(theirs[i])), int(np.argmax(mine[i]))
                    if a != m:
                        near = mine[i][m] - mine[i][a] <= 2 * tf_diff
                        ties += near
                        bad += not near
                forced = N_NEW - ties - bad
                # a near tie is one only while the two sides' logits agree closely: f32 and f16 also held to
                # F16_TOL of the spread (the prompt's last logits) and FORCED_TOL (every forced position's)
                close = diff <= F16_TOL * spread and tf_diff <= FORCED_TOL * spread
                held = tok_ok and (bad == 0 and close if dtype != "q8_0" else diff <= Q8_TOL * spread)
                failed += not held
                where = "" if first is None else f" (first differs at {first})"
                rows.append(
                    (
                        family,
                        kind,
                        dtype,
                        f"tok {'=' if tok_ok else '!='}  greedy {same}/{N_NEW}{where}  "
                        f"forced {forced}/{N_NEW}{f' + {ties} near ties' if ties else ''}"
                        f"{f' + {bad} apart' if bad else ''}  "
                        f"max|dlogit| {diff:.2e} ({diff / spread:.1e} of the spread; forced "
                        f"{tf_diff / spread:.1e})  "
                        f"{'ok' if held else 'FAILED'}",
                    )
                )
                del llm
    if not sys.argv[1:] or "chat" in sys.argv[1:]:
        said, held = chat_row(root, text)
        rows.append(("Llama", "char", "chat", said))
        failed += not held
    print(f"{'family':<8} {'tokenizer':<9} {'type':<5} llama.cpp (llama-cpp-python) vs gptkit")
    for row in rows:
        print(f"{row[0]:<8} {row[1]:<9} {row[2]:<5} {row[3]}")
    print(f"gguf check: {len(rows)} rows, {failed} failed, {time.time() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
