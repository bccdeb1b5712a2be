"""`gptkit bench sample bench.parts=[llamacpp]`: one-row decode per token against llama.cpp on the same
weights (its Python binding, llama-cpp-python's C API, in this process), CPU, bench.llamacpp.threads
threads on every side (1: one core each).

    gptkit fp32          generate() (the CPU decoding layout), greedy
    llama.cpp f32        the same weights exported to GGUF in F32 (gptkit.hf.gguf_file, `export format=gguf`)
    gptkit int8          generate() with quantize=int8 (gptkit/quant.py: on the CPU gptkit's int8 kernel,
                         gptkit/quant_int8.py; the block projections and the LM head)
    gptkit w8a8          generate() with quantize=w8a8 (gptkit/quant_w8a8.py: int8's weights and int8
                         activations per row, fbgemm's int8 x int8 matmul)
    llama.cpp Q8_0       the same weights exported to GGUF in Q8_0 (blocks of 32 values, an fp16 scale each;
                         token_embd and output too)

The model is a conf/model preset with random init (bench.llamacpp.model), saved as a run with bench serve's
character tokenizer (serve_peers.vocab_chars); llama.cpp is fed token ids (llama_decode, the next token the
argmax of its logits: greedy), so no text is tokenized on either side. ms per token = (time(new_tokens) -
time(1 new token)) / (new_tokens - 1) over bench.llamacpp.prompts prompts (the prefill cancels out,
decode.py's measure), the sides in turn, bench.llamacpp.repeats rounds after one warm-up (median,
min-max), by bench.clock (cpu: this process's CPU seconds, llama.cpp's threads included). Greedy agreement:
prompts whose new tokens are all the same as those of the side's engine on full weights (llama.cpp f32:
gptkit fp32's). Without llama-cpp-python (or gguf, the writer): one line, and the gptkit sides alone.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf
from rich.table import Table

from gptkit.bench.measure import loadavg
from gptkit.bench.serve_peers import _has, vocab_chars
from gptkit.errors import ConfigError, GptkitError
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions

# the run's end-of-text token (bench serve's): the character tokenizer's last id
EOS = "<|endoftext|>"
# side -> (which engine, its weights)
SIDES = {
    "gptkit fp32": ("gptkit", None),
    "llama.cpp f32": ("llama.cpp", "fp32"),
    "gptkit int8": ("gptkit", "int8"),
    "gptkit w8a8": ("gptkit", "w8a8"),
    "llama.cpp Q8_0": ("llama.cpp", "q8_0"),
}
# the pairs compared: (side, the side it is measured against)
PAIRS = (
    ("gptkit fp32", "llama.cpp f32"),
    ("gptkit int8", "llama.cpp Q8_0"),
    ("gptkit w8a8", "llama.cpp Q8_0"),
)


def gptkit_side(model, prompts: list[list[int]]):
    """n -> each prompt's n greedy new tokens from gptkit's generate()."""
    opts = lambda n: SampleOptions(max_new_tokens=n, temperature=0, eos_id=None)  # noqa: E731

    def run(n: int) -> list[list[int]]:
        return [generate(model, p, opts(n)).tokens[0] for p in prompts]

    return run


def llama_side(path: Path, prompts: list[list[int]], context: int, threads: int, extra_buffers: bool):
    """n -> each prompt's n greedy new tokens from llama.cpp through llama-cpp-python's C API (llama_decode on
    token ids, the argmax of the last logits; the cache cleared between prompts). extra_buffers: llama.cpp's
    extra weight layouts (its repacked and AMX ones), llama_model_params.use_extra_bufts."""
    import ctypes

    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    # its log lines (a context above the model's is only a note) stay out of the bench's output
    quiet = lc.llama_log_callback(lambda level, text, data: None)
    lc.llama_log_set(quiet, ctypes.c_void_p())
    mp = lc.llama_model_default_params()
    mp.use_extra_bufts = extra_buffers
    model = lc.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise GptkitError(f"llama.cpp could not load {path}")
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = context, 512, 512
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cp)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))

    def decode(ids: list[int]) -> int:
        arr = (lc.llama_token * len(ids))(*ids)
        if lc.llama_decode(ctx, lc.llama_batch_get_one(arr, len(ids))) != 0:
            raise GptkitError("llama.cpp: llama_decode failed")
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    def run(n: int) -> list[list[int]]:
        out = []
        for p in prompts:
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            new = [decode(p)]
            while len(new) < n:
                new.append(decode([new[-1]]))
            out.append(new)
        return out

    # kept alive with the closure: the callback, the model and its context
    run.keep = (quiet, model, ctx)
    return run


def agree(a: list[list[int]], b: list[list[int]]) -> str:
    """'k/n': prompts whose new tokens are all the same."""
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def missing() -> str | None:
    """Why the llama.cpp sides cannot run here (None: they can)."""
    if not _has("llama_cpp"):
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    if not _has("gguf"):
        return "gguf (the GGUF writer) is not installed (pip install 'gptkit[gguf]')"
    return None


def run(cfg, clock, clock_name: str, console, build_model, measure_interleaved) -> dict:
    """The part with the `bench.llamacpp` group (module docstring)."""
    from gptkit import quant
    from gptkit.runs import load_model, write_run_folder
    from gptkit.tokenizer import char_tokenizer

    threads = int(cfg.threads)
    if threads < 1:
        raise ConfigError(f"bench.llamacpp.threads={cfg.threads} must be >= 1")
    sides = [str(s) for s in cfg.sides]
    wrong = [s for s in sides if s not in SIDES]
    if wrong:
        raise ConfigError(f"bench.llamacpp.sides: {', '.join(wrong)} is not one of {', '.join(SIDES)}")
    new_tokens, repeats = int(cfg.new_tokens), int(cfg.repeats)
    if new_tokens < 2 or repeats < 1:
        raise ConfigError("bench.llamacpp.new_tokens must be >= 2 and bench.llamacpp.repeats >= 1")
    why = missing()
    if why is not None:
        console.print(f"llamacpp: the llama.cpp sides skipped: {why}")
        sides = [s for s in sides if SIDES[s][0] == "gptkit"]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    spec = OmegaConf.to_container(cfg.model, resolve=True)
    model = build_model(spec)
    vocab = model.cfg.vocab_size
    context = int(cfg.prompt_tokens) + new_tokens
    if context > model.cfg.max_seq_len:
        raise ConfigError(
            f"bench.llamacpp.prompt_tokens + new_tokens = {context} exceed the model's context "
            f"({model.cfg.max_seq_len})"
        )
    g = torch.Generator().manual_seed(0)
    # ids below the end-of-text token (the tokenizer's last)
    prompts = [
        torch.randint(0, vocab - 1, (int(cfg.prompt_tokens),), generator=g).tolist()
        for _ in range(int(cfg.prompts))
    ]
    results: dict = {
        "model": spec,
        "params": model.num_parameters(),
        "threads": threads,
        "clock": clock_name,
        "prompts": len(prompts),
        "prompt_tokens": int(cfg.prompt_tokens),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "load_before": loadavg(),
        "skipped": why,
        "rows": {},
    }
    fns = {}
    try:
        with tempfile.TemporaryDirectory(prefix="gptkit-bench-llamacpp-") as tmp:
            run_dir = write_run_folder(
                Path(tmp) / "run",
                {"tokenizer": {"eos_token": EOS}},
                model,
                char_tokenizer(vocab_chars(vocab - 1), [EOS]),
            )
            for side in sides:
                engine, weights = SIDES[side]
                if engine == "gptkit":
                    m = model
                    if weights is not None:
                        *_, m = load_model(run_dir, quantize=weights)
                    fns[side] = gptkit_side(m, prompts)
                else:
                    from gptkit.hf.gguf_file import export_gguf

                    out = export_gguf(run_dir, Path(tmp) / f"gguf-{weights}", weights)
                    results.setdefault("gguf_bytes", {})[side] = out.path.stat().st_size
                    fns[side] = llama_side(out.path, prompts, context, threads, bool(cfg.extra_buffers))
            rates = measure_interleaved(list(fns.values()), len(prompts), new_tokens, repeats, clock)
            tokens = {side: fn(new_tokens) for side, fn in fns.items()}
    finally:
        torch.set_num_threads(saved)
    results["load_after"] = loadavg()
    # each side's greedy tokens against its engine's full weights (llama.cpp f32: against gptkit's)
    reference = {
        "llama.cpp f32": "gptkit fp32",
        "gptkit int8": "gptkit fp32",
        "gptkit w8a8": "gptkit fp32",
        "llama.cpp Q8_0": "llama.cpp f32",
    }
    for side, rate in zip(fns, rates):
        ms = 1e3 / rate.median
        row = {
            "ms_per_token": ms,
            # the fastest round gives the lowest ms
            "ms_min": 1e3 / rate.high,
            "ms_max": 1e3 / rate.low,
        }
        ref = reference.get(side)
        if ref in tokens:
            row["same_tokens_as"] = ref
            row["same"] = agree(tokens[side], tokens[ref])
        results["rows"][side] = row
    for side, against in PAIRS:
        if side in results["rows"] and against in results["rows"]:
            results["rows"][side][f"x {against}"] = (
                results["rows"][side]["ms_per_token"] / results["rows"][against]["ms_per_token"]
            )
    for side in ("gptkit int8", "gptkit w8a8"):
        if side in results["rows"] and "gptkit fp32" in results["rows"]:
            r = results["rows"][side]
            r["x gptkit fp32"] = r["ms_per_token"] / results["rows"]["gptkit fp32"]["ms_per_token"]
    results["int8_layout"] = quant.int8_layout("cpu")
    table = Table(
        title=f"one-row decode, ms per token ({clock_name} clock; {len(prompts)} prompts of "
        f"{cfg.prompt_tokens} + {new_tokens} greedy tokens; {threads} thread(s) a side; median of {repeats} "
        f"interleaved rounds (min-max)); {model.num_parameters() / 1e6:.1f}M parameters; load "
        f"{results['load_before']} -> {results['load_after']}"
    )
    for col in ("side", "ms per token", "/ llama.cpp", "same greedy tokens"):
        table.add_column(col, justify="left" if col == "side" else "right")
    for side, row in results["rows"].items():
        against = dict(PAIRS).get(side)
        ratio = row.get(f"x {against}")
        table.add_row(
            side,
            f"{row['ms_per_token']:.2f} ({row['ms_min']:.2f}-{row['ms_max']:.2f})",
            f"{ratio:.2f}x" if ratio is not None else "-",
            f"{row['same']} as {row['same_tokens_as']}" if "same" in row else "-",
        )
    console.print(table)
    return results
