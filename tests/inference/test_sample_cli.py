"""`gptkit sample` as a user runs it: output, --json, and one-line errors for bad input.

Two cases run as a subprocess (the real entry point); the rest call gptkit.cli.main in process,
the same code path without paying for a new interpreter and torch import each time.
"""

import json

import pytest
import torch
from conftest import SAMPLE_EOS as EOS
from conftest import make_run, run_main

from gptkit.checkpoints import CHECKPOINT_DIR
from gptkit.inference.generate import encode_prompt, generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("sample"))


def test_greedy_text_streams_what_the_library_generates(run_dir, cli):
    d, model, tok = run_dir
    # a comma: passed verbatim, not a Hydra sweep
    prompt = "ROMEO: O, she doth teach"
    ids = encode_prompt(tok, prompt, None)
    want = generate(
        model,
        ids,
        SampleOptions(max_new_tokens=30, temperature=0, eos_id=tok.token_to_id(EOS)),
        decode=tok.decode,
    )
    r = cli("sample", f"run={d}", f"prompt={prompt}", "greedy=true", "max_new_tokens=30", "device=cpu")
    assert r.returncode == 0, r.stderr
    # streamed text, then a newline
    assert r.stdout == prompt + want.texts[0] + "\n"
    assert "decode" in r.stderr and "tokens/s" in r.stderr


def test_json_batch_of_samples_is_reproducible(run_dir, capsys):
    d, model, tok = run_dir
    prompt = "ROMEO: O, she doth teach"
    ids = encode_prompt(tok, prompt, None)
    code, stdout, stderr = run_main(
        capsys,
        "sample",
        f"run={d}",
        f"prompt={prompt}",
        "max_new_tokens=12",
        "num_samples=3",
        "seed=5",
        "temperature=1.0",
        "top_k=20",
        "top_p=0.9",
        "--json",
    )
    assert code == 0, stderr
    # JSON Lines: one complete object per sample
    lines = stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("{") for line in lines)
    samples = [json.loads(line) for line in lines]
    assert [s["sample"] for s in samples] == [1, 2, 3]
    assert all(s["prompt"] == prompt and s["prompt_tokens"] == len(ids) for s in samples)
    want = generate(
        model,
        ids,
        SampleOptions(
            max_new_tokens=12,
            temperature=1.0,
            top_k=20,
            top_p=0.9,
            seed=5,
            num_samples=3,
            eos_id=tok.token_to_id(EOS),
        ),
        decode=tok.decode,
    )
    # same seed, same draws
    assert [s["tokens"] for s in samples] == want.tokens
    assert [s["text"] for s in samples] == want.texts


def test_empty_prompt_starts_from_bos_and_stop_string(run_dir, capsys):
    # <|endoftext|> serves as BOS, as in GPT-2
    d, model, tok = run_dir
    code, stdout, stderr = run_main(
        capsys, "sample", f"run={d}", "prompt=", "greedy=true", "max_new_tokens=40", "stop=e", "--json"
    )
    assert code == 0, stderr
    s = json.loads(stdout)
    full = generate(
        model, [tok.token_to_id(EOS)], SampleOptions(max_new_tokens=40, temperature=0), decode=tok.decode
    ).texts[0]
    # otherwise the stop string is never reached
    assert "e" in full
    assert s["stop_reason"] == "stop" and s["text"] == full[: full.index("e")]


def test_unknown_characters_are_named(run_dir, cli):
    r = cli("sample", f"run={run_dir[0]}", "prompt=Caf\u00e9 \u20ac")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "'é' (U+00E9), '€' (U+20AC)" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["top_p=0"], "top_p=0.0 must be in (0, 1]"),
        (["top_p=1.5"], "top_p=1.5 must be in (0, 1]"),
        (["temperature=-0.5"], "temperature=-0.5 must be >= 0"),
        (["top_k=-1"], "top_k=-1 must be a non-negative integer"),
        (["overflow=wrap"], "overflow='wrap' is not one of slide, stop"),
    ],
)
def test_nonsense_sampling_values_are_one_line(run_dir, capsys, args, message):
    code, _, err = run_main(capsys, "sample", f"run={run_dir[0]}", "prompt=hi", "device=cpu", *args)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_prompt_and_prompt_file_together_are_refused_in_one_line(run_dir, tmp_path, capsys):
    d, _, _ = run_dir
    f = tmp_path / "a.txt"
    f.write_text("ROMEO")
    code, out, err = run_main(
        capsys, "sample", f"run={d}", "prompt=hi", f"prompt_file={f}", "max_new_tokens=2"
    )
    assert code == 2 and out == ""
    assert err.strip() == (
        f"error: prompt= and prompt_file={f} both give the prompt; give one of them (prompt_file= for text "
        "that is awkward to quote)"
    )
    # the file alone is the prompt
    code, out, err = run_main(
        capsys, "sample", f"run={d}", f"prompt_file={f}", "max_new_tokens=2", "stream=false", "--json"
    )
    assert code == 0 and json.loads(out)["prompt"] == "ROMEO", err


def test_bad_run_folders_are_one_line(tmp_path, capsys):
    d, _, _ = make_run(tmp_path, eos=False, position="learned")
    # the default prompt, ""
    code, out, err = run_main(capsys, "sample", f"run={d}", "max_new_tokens=3")
    assert code == 0 and out and 'the sample starts after a newline ("\\n") (not printed)' in err, err

    cfg = (d / "config.yaml").read_text()
    (d / "config.yaml").write_text(cfg.replace("d_model: 32", "d_model: 64"))
    code, _, err = run_main(capsys, "sample", f"run={d}", "prompt=hi")
    assert code == 2 and "does not match its config" in err and "shape" in err and err.count("\n") == 1

    for f in (d / CHECKPOINT_DIR).iterdir():
        f.unlink()
    code, _, err = run_main(capsys, "sample", f"run={d}", "prompt=hi")
    assert code == 2 and "no checkpoint in" in err and err.count("\n") == 1


@pytest.mark.long
def test_bench_sample_agrees_with_transformers(tmp_path, cli):
    """`gptkit bench sample` on two small models, batch 1 and 3: both sides decode the same greedy tokens, the
    rates (median and min-max of the repeats) are positive, and the context sweep is written."""
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    r = cli(
        "bench",
        "sample",
        "~bench.models",
        "+bench.models={g:{preset:gpt2-tiny,max_seq_len:64},l:{preset:llama-tiny,vocab_size:500}}",
        # the decode tables only: parts=[quantize] is tests/inference/test_quantize.py's
        "parts=[decode]",
        "batch_sizes=[1,3]",
        "new_tokens=6",
        "repeats=2",
        "context_model=g",
        "context_lens=[8]",
        "context_steps=2",
        f"out={out}",
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert [(row["model"], row["batch"]) for row in res["decode"]] == [("g", 1), ("g", 3), ("l", 1), ("l", 3)]
    for row in res["decode"]:
        assert row["same_tokens"] == 1.0, row
        assert 0 < row["gptkit_min"] <= row["gptkit_tokens_per_s"] <= row["gptkit_max"]
        assert 0 < row["transformers_min"] <= row["transformers_tokens_per_s"] <= row["transformers_max"]
        assert row["read_roofline_tokens_per_s"] > 0 and row["gptkit_of_roofline"] > 0
    assert [c["context"] for c in res["context"]] == [8] and res["context"][0]["cache_ms"] > 0
    assert "read roofline" in r.stdout


def test_bench_sample_latent_measures_mlas_cache_against_the_expanded_one_and_mha(tmp_path, cli):
    """parts=[latent] (shrunk to a 24-token context): the latent cache holds 80 numbers per token per layer
    against the expanded one's 320 and MHA's 256, its bytes are count-params' figure, both MLA sides decode
    the same greedy tokens, the rates are positive."""
    out = tmp_path / "bench.json"
    short = [f"latent.models.{m}.max_seq_len=64" for m in ("mla", "mla-expanded", "mha")]
    r = cli(
        "bench",
        "sample",
        "parts=[latent]",
        *short,
        "latent.context=24",
        "latent.steps=2",
        "latent.repeats=1",
        f"out={out}",
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())["latent"]
    rows = {row["model"]: row for row in res["rows"]}
    assert [rows[m]["cached_per_token_per_layer"] for m in ("mla", "mla-expanded", "mha")] == [80, 320, 256]
    assert rows["mla"]["kv_cache_bytes"] == 4 * 24 * 80 * 4 == rows["mla"]["kv_cache_bytes_count_params"]
    assert rows["mla-expanded"]["kv_cache_bytes"] == 4 * rows["mla"]["kv_cache_bytes"]
    assert abs(rows["mha"]["params"] / rows["mla"]["params"] - 1) < 1e-3
    assert res["same_tokens"] is True and all(row["tokens_per_s"] > 0 for row in rows.values())


@pytest.mark.long
def test_bench_sample_quantize_holds_quantized_weights_against_the_full_model(tmp_path, cli):
    """parts=[quantize] on a given run: the full model agrees with itself, int8 weights are smaller with a
    perplexity close to it, and the agreement figures are written."""
    pytest.importorskip("torchao")
    run, _, _ = make_run(tmp_path)
    out = tmp_path / "bench.json"
    r = cli(
        "bench",
        "sample",
        "parts=[quantize]",
        f"quantize.run={run}",
        "quantize.kinds=[int8]",
        "quantize.prompts=2",
        "quantize.prompt_tokens=8",
        "quantize.new_tokens=8",
        "quantize.eval_windows=4",
        f"out={out}",
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["quantize"]["rows"]
    assert set(rows) == {"full", "int8"}
    assert rows["full"]["agreement"] == 1.0 and rows["int8"]["weights"] < rows["full"]["weights"]
    full, int8 = rows["full"]["eval"]["perplexity"], rows["int8"]["eval"]["perplexity"]
    # an untrained model: its greedy choices are near ties, so int8 may part from it early
    assert abs(int8 / full - 1) < 0.05 and 0 <= rows["int8"]["agreement"] <= 1
    assert 0 <= rows["int8"]["first_difference"] <= 8 == rows["full"]["first_difference"]


@pytest.mark.long
def test_bench_sample_llamacpp_times_each_side_on_the_same_weights(tmp_path, cli):
    """parts=[llamacpp] on a tiny Llama: the five sides (gptkit fp32, int8 and w8a8, llama.cpp f32 and Q8_0
    from the GGUF export) each get a positive ms per token within its min-max, the pairs their ratio, the
    agreement 'k/n' of the prompts; the Q8_0 file is smaller than the F32 one."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    pytest.importorskip("gguf")
    out = tmp_path / "bench.json"
    r = cli(
        "bench",
        "sample",
        "parts=[llamacpp]",
        "~bench.llamacpp.model",
        "+bench.llamacpp.model={preset:llama-tiny,vocab_size:512,n_layers:2,d_model:64,n_heads:4,n_kv_heads:2,"
        "d_ff:128,max_seq_len:64}",
        "llamacpp.prompts=2",
        "llamacpp.prompt_tokens=8",
        "llamacpp.new_tokens=4",
        "llamacpp.repeats=1",
        "llamacpp.sides=[gptkit fp32,llama.cpp f32,gptkit int8,gptkit w8a8,llama.cpp Q8_0]",
        f"out={out}",
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())["llamacpp"]
    rows = res["rows"]
    assert list(rows) == ["gptkit fp32", "llama.cpp f32", "gptkit int8", "gptkit w8a8", "llama.cpp Q8_0"]
    for row in rows.values():
        assert 0 < row["ms_min"] <= row["ms_per_token"] <= row["ms_max"]
    assert rows["gptkit fp32"]["x llama.cpp f32"] > 0 and rows["gptkit int8"]["x llama.cpp Q8_0"] > 0
    assert rows["gptkit w8a8"]["x llama.cpp Q8_0"] > 0 and rows["gptkit w8a8"]["x gptkit fp32"] > 0
    same = {side: row["same"] for side, row in rows.items() if "same" in row}
    assert set(same) == {"llama.cpp f32", "gptkit int8", "gptkit w8a8", "llama.cpp Q8_0"}
    assert all(v.endswith("/2") and 0 <= int(v[0]) <= 2 for v in same.values())
    assert res["gguf_bytes"]["llama.cpp Q8_0"] < res["gguf_bytes"]["llama.cpp f32"] / 2
    assert "one-row decode, ms per token" in r.stdout


def test_read_roofline_is_the_batch_over_the_time_to_read_a_step(monkeypatch):
    """It reads decode_bytes_per_step bytes (the weights once, the K/V at the context) per timing."""
    import torch

    from gptkit.accounting import decode_bytes_per_step
    from gptkit.bench.decode import read_roofline

    model = GPT(ModelConfig(vocab_size=100, max_seq_len=32, n_layers=1, n_heads=2, d_model=16))
    sizes = []
    real_ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda n, **kw: sizes.append(n) or real_ones(n, **kw))
    # the clock advances 1 s per call: every read takes 1 s
    ticks = iter(range(0, 1000))
    assert read_roofline(model, 4, 20, 3, clock=lambda: next(ticks)) == 4.0
    assert sizes == [decode_bytes_per_step(model.cfg, 4, 20, "fp32") // 4]


def test_bench_sample_decode_steps_restart_a_longrope_cache_as_sample_does():
    """The bench's cached decode steps (per_token_ms, bench.parts=[latent]) cross a longrope scaling's
    original context as generate() does, filling the cache again: the greedy token after each step is
    sample's, past the switch too (without the restart the keys cached with the short factors were kept)."""
    from conftest import greedy_gpt

    from gptkit.bench.decode import cached_steps
    from gptkit.model import KVCache

    # greedy_gpt: width 32, 4 heads
    scaling = {"type": "longrope", "factor": 4.0, "original_max_seq_len": 20}
    scaling |= {"short_factor": [1.0] * 4, "long_factor": [3.0] * 4}
    model = greedy_gpt(64, position="rope", rope_scaling=scaling)
    prompt = torch.randint(0, 61, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = 16
    want = generate(model, prompt, SampleOptions(max_new_tokens=steps + 1, temperature=0.0)).tokens[0]
    seq = torch.tensor([prompt + want])  # [1, 12 + steps + 1]
    cache = KVCache(model.cfg, 1, max_len=seq.shape[1])
    with torch.inference_mode():
        model(seq[:, : len(prompt)], cache=cache, logits_to_keep=1)
        got = [int(x.argmax()) for x in cached_steps(model, seq, len(prompt), steps, cache)]
    # the switch (20 tokens) lies within the steps
    assert len(prompt) < 20 < len(prompt) + steps
    assert got == want[1:]


@pytest.mark.parametrize(
    "override, message",
    [
        ("bench.models.gpt2-15m=null", "must be a mapping with a preset"),
        ("bench.models.gpt2-15m.preset=nope", "unknown model preset 'nope'"),
    ],
)
def test_bench_sample_bad_model_is_one_line(capsys, override, message):
    code, _, err = run_main(capsys, "bench", "sample", "~bench.models.llama-tiny", override, "hf=false")
    assert code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.long
def test_bench_sample_cuda_pipeline_dry_run_on_cpu(monkeypatch, capsys):
    """The GPU comparison (`bench.device=cuda`) run on the CPU with tiny models: every side runs (decode=graph
    falls back to the static path with its note; the compiled side traces with aot_eager instead of building
    C++), rows stream as they finish, fp32 greedy tokens agree across all sides, and the roofline is
    computed."""
    pytest.importorskip("transformers")
    from omegaconf import OmegaConf

    import gptkit.inference.static_decode as sd
    from gptkit.accounting import decode_bytes_per_step
    from gptkit.bench import decode as bench
    from gptkit.conf_tree import conf_dir

    compiled = sd.compiled_forward
    monkeypatch.setattr(sd, "compiled_forward", lambda backend: compiled("aot_eager"))
    # the shipped options
    cfg = OmegaConf.load(conf_dir() / "bench" / "sample.yaml")
    # every side, by default
    assert list(cfg.cuda.sides) == list(bench.SIDES)
    cfg.cuda.models = {
        "g": {"preset": "gpt2-tiny", "max_seq_len": 64, "vocab_size": 300},
        "l": {"preset": "llama-tiny", "vocab_size": 500},
    }
    cfg.cuda.update(batch_sizes=[1, 2], new_tokens=6, repeats=1, dtype="fp32", hbm_gbps=10)
    res = bench.run_cuda(cfg, torch.device("cpu"))
    out = capsys.readouterr().out
    rows = res["decode"]
    assert [(r["model"], r["batch"], r["side"]) for r in rows] == [
        (m, b, s) for m in ("g", "l") for b in (1, 2) for s in bench.SIDES
    ]
    assert all(r["same_tokens"] == 1.0 and r["same_tokens_as"] == "gptkit-eager" for r in rows)
    assert all(r["first_token_ms"] > 0 for r in rows)
    r = rows[0]
    model = bench.build_model({"preset": "gpt2-tiny", "max_seq_len": 64, "vocab_size": 300})
    step_bytes = decode_bytes_per_step(model.cfg, 1, 16 + 3, "fp32")
    assert r["roofline_tokens_per_s"] == pytest.approx(10e9 / step_bytes)
    assert "g batch 1 gptkit-eager:" in out and "of the HBM roofline" in out
    # gptkit-graph and -compiled, 4 cases
    assert out.count("note: decode=graph needs a CUDA device") == 8
    assert "vs transformers-static" in out


def test_bench_sample_refuses_cuda_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, _, err = run_main(capsys, "bench", "sample", "device=cuda")
    assert code == 2 and "bench.device=cuda needs a CUDA GPU" in err and err.count("\n") == 1, err


def test_sample_decode_static_prints_what_eager_prints(run_dir, capsys):
    d, model, tok = run_dir
    outs = []
    for mode in ("eager", "static"):
        code, stdout, stderr = run_main(
            capsys,
            "sample",
            f"run={d}",
            "prompt=ROMEO:",
            "greedy=true",
            "max_new_tokens=40",
            "device=cpu",
            f"decode={mode}",
            "check_every=7",
        )
        assert code == 0, stderr
        assert f"({mode})" in stderr
        outs.append(stdout)
    assert outs[0] == outs[1]
    code, _, err = run_main(capsys, "sample", f"run={d}", "prompt=hi", "decode=fast")
    assert code == 2 and "decode='fast' is not one of auto, eager, static, graph" in err
    assert err.count("\n") == 1
    code, _, err = run_main(capsys, "sample", f"run={d}", "prompt=hi", "compile=sometimes")
    assert code == 2 and "compile='sometimes' must be auto, true or false" in err and err.count("\n") == 1


def test_a_prompt_that_spells_a_special_token_is_its_text(run_dir, capsys):
    """Text is data: `<|endoftext|>` typed in a prompt is its characters, not the end-of-text id (unless
    special_tokens_in_content=allow)."""
    from gptkit.tokenizer import byte_tokenizer

    tok = byte_tokenizer([EOS])
    eos = tok.token_to_id(EOS)
    text = encode_prompt(tok, f"hi{EOS}", None)
    assert text == list(f"hi{EOS}".encode()) and eos not in text
    assert encode_prompt(tok, f"hi{EOS}", None, allow_special_text=True) == [*b"hi", eos]
    d, _, _ = run_dir
    code, _, stderr = run_main(capsys, "sample", f"run={d}", "prompt=hi", "special_tokens_in_content=maybe")
    assert code == 2 and "special_tokens_in_content='maybe' must be text" in stderr
