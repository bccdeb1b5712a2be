"""Test environment: offline hubs, offline wandb, the Triton interpreter, a private cache.

TRITON_INTERPRET must be set before the kernel module is imported, so it is set here, first.
"""

import contextlib
import os
import signal
import subprocess
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
# On a GPU the kernels launch one pinned configuration each instead of autotuning
# (kernels/gptkit_kernels/_tuning.py): the compiled kernel tests stay within a minute; the autotuner runs in
# training and `gptkit bench`.
os.environ.setdefault("GPTKIT_KERNELS_AUTOTUNE", "0")
# pytest -n 2 runs two workers on two cores: one thread each (and in their subprocesses) avoids
# oversubscription, which makes small CPU kernels several times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
# the Ctrl-C tests send real SIGINTs: a shell without job control starts background commands with SIGINT
# ignored, which every process the tests start inherits (Python then never raises KeyboardInterrupt); the
# default handler here, reset to the default action in each child at exec
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# a private cache, removed when the test session ends
if "GPTKIT_CACHE" not in os.environ:
    import atexit
    import shutil

    os.environ["GPTKIT_CACHE"] = tempfile.mkdtemp(prefix="gptkit-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GPTKIT_CACHE"], True)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# how long a test waits for a subprocess before calling it a hang: a guard, never a speed limit (a loaded
# 2-core machine runs the suite several times slower; no test asserts how fast anything is)
HANG_S = 900


def pytest_addoption(parser):
    parser.addoption(
        "--long",
        action="store_true",
        help="also run the tests marked long (the slowest end-to-end checks: further kill points, signals, "
        "process layouts, benchmarks' CPU dry runs, Triton-interpreter variants; .ci/long-tests runs "
        "them, and .ci/run calls it)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "long: one of the slowest end-to-end checks; run by .ci/long-tests (--long), which .ci/run calls",
    )


def pytest_collection_modifyitems(config, items):
    """The README's `pytest -n 2 -q` skips the tests marked long, and says so in its summary: each is
    among the slowest tests (a further kill point, signal or process layout of a check the suite makes once
    already, a benchmark's CPU dry run, a Triton-interpreter or whole-CLI variant of a check made on the model
    directly), kept out so the suite stays under its 10 minutes. `.ci/long-tests` (called by .ci/run) runs
    them with `--long -m long`, and .ci/gpu-check with its kernel steps."""
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long: run by .ci/long-tests (pytest --long)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


@pytest.fixture(autouse=True)
def _no_leaked_dist_env():
    """An in-process run with a process group (trainer=fsdp on one device) leaves Lightning's MASTER_PORT in
    os.environ and its store listening on that port in this process: a later test's 2-process job would
    inherit the port and fail with EADDRINUSE (it did). Each test ends with these variables as it began."""
    before = {k: os.environ.get(k) for k in DIST_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with torch.compile's caches empty: a worker process runs many tests that compile the
    same functions (Block.forward, the decode step) for other models, and a fullgraph compile fails once a
    function's recompile limit is reached (it did, in test_lora's compile test after other compiled tests
    on the same xdist worker). Resetting empty caches costs ~10 microseconds."""
    yield
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def shakespeare(n_chars: int | None = None, start: int = 0) -> str:
    """Text of the built-in corpus (data=shakespeare): what the product ships, nothing from outside the
    repo."""
    from gptkit.data.sources import shakespeare_text

    text = shakespeare_text()
    return text[start:] if n_chars is None else text[start : start + n_chars]


def small_tasks(monkeypatch) -> None:
    """Pieces and tokenization tasks small enough that a corpus of a few tens of kB is many byte ranges and
    its long documents many pieces (test_data_jsonl, test_data_text)."""
    monkeypatch.setattr("gptkit.data.tokenize.PIECE_CHARS", 700)
    monkeypatch.setattr("gptkit.data.tokenize.HARD_CHARS", 1500)
    monkeypatch.setattr("gptkit.data.tokenize.BATCH_CHARS", 3000)


def prepare_error(tmp_path, monkeypatch, switch: str, files, ranges: bool, tok=None, workers: int = 1) -> str:
    """The one-line error of preparing `files` with gptkit.data.sources.<switch> (JSONL_RANGES, TEXT_RANGES)
    set to `ranges`: the byte-range path or the one before it (test_data_jsonl, test_data_text)."""
    from gptkit.data import prepare, sources
    from gptkit.errors import GptkitError

    monkeypatch.setattr(sources, switch, ranges)
    with pytest.raises(GptkitError) as exc:
        prepare(
            {"kind": "files", "paths": [str(f) for f in files], "workers": workers},
            tok or {"kind": "byte"},
            cache_dir=tmp_path / f"c{ranges}",
            progress=False,
        )
    return str(exc.value)


def interrupt_prepare(monkeypatch, data, tok, cache_dir, at: int) -> dict:
    """Prepare (data, tok) into cache_dir and stop it (Ctrl-C) at its `at`-th input task; returns the partial
    build's progress.json (the next prepare continues it)."""
    import json

    from gptkit.data import prepare, shards

    real, seen = shards.fault_point, []

    def interrupt(name):
        seen.append(name)
        if seen.count("prepare-batch") == at:
            raise KeyboardInterrupt
        real(name)

    monkeypatch.setattr(shards, "fault_point", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare(data, tok, cache_dir=cache_dir, progress=False)
    monkeypatch.setattr(shards, "fault_point", real)
    (partial,) = Path(cache_dir).glob(".*.partial")
    return json.loads((partial / "progress.json").read_text())


def metaspace_tokenizer(path, eos="<|endoftext|>"):
    """A tokenizer.json that no fast path knows (Metaspace BPE): cut only where its own encoding verifies.
    Saved at `path`; returns the path as a string."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(
        [shakespeare(20_000), "日本語のテキスト。café 😀 42"],
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", eos], show_progress=False),
    )
    tok.save(str(path))
    return str(path)


def shard_bytes(p):
    """The bytes of a prepared folder's shards and tokenizer (what must be bit-identical)."""
    return {n: (p.dir / n).read_bytes() for n in ("train.bin", "val.bin", "tokenizer.json")}


def run_cli(*args, env=None, cwd=None, timeout=HANG_S):
    """Run `python -m gptkit ...` as a subprocess (the way a user runs it); return CompletedProcess."""
    import subprocess

    e = dict(os.environ)
    e.pop("GPTKIT_VERB", None)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gptkit", *args],
        capture_output=True,
        text=True,
        env=e,
        cwd=cwd,
        timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli


def wait_for(ready, procs, guard_s: float = 1800) -> None:
    """Wait until ready() holds while `procs` (a Popen, or a list of them) run: however slowly a loaded
    machine gets there. The test fails, with the process's stderr, if one exits first. The guard counts
    polls, 0.2 s of sleep each, not the clock: it only stops a hang, and a loaded machine stretches it (no
    speed limit)."""
    import time

    procs = procs if isinstance(procs, list) else [procs]
    for _ in range(int(guard_s / 0.2)):
        if ready():
            return
        for proc in procs:
            if proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr else ""
                raise AssertionError(
                    f"a process exited ({proc.returncode}) before it was ready: {err[-3000:]}"
                )
        time.sleep(0.2)
    raise AssertionError(f"not ready after {int(guard_s / 0.2)} polls (a hang?)")


def run_main(capsys, *args) -> tuple[int, str, str]:
    """gptkit.cli.main(args) in process -> (exit code, stdout, stderr) of that call alone."""
    from gptkit.cli import main

    # what earlier calls printed is not this call's
    capsys.readouterr()
    try:
        code = main(list(args))
    # an error: main prints one line and exits
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# ---- helpers several test files share (a test file imports them from here, never from another test file)
def as_text(tok):
    """A prepared folder's tokenizer, set to encode special tokens' strings as text (HF's
    encode_special_tokens): what prepare makes of a corpus that spells one (by default)."""
    tok.encode_special_tokens = True
    return tok


# the tiny Llama-style model of many tests: 2 layers of 4 heads (2 of keys and values), width 32, RoPE,
# SwiGLU, RMSNorm, no biases (ModelConfig(**TINY_LLAMA, ...) or dict(TINY_LLAMA, ...) with what differs)
TINY_LLAMA = dict(
    n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, position="rope", mlp="swiglu", norm="rmsnorm", bias=False
)


def greedy_gpt(max_seq_len: int, seed: int = 0, **fields):
    """A random tiny GPT (vocabulary 61, 2 layers of 4 heads, width 32, untied; `fields` its variant) whose
    init_std 0.3 sets logits far apart, so that greedy choices never meet a near-tie (test_generate,
    test_batcher)."""
    import torch

    from gptkit.model import GPT, ModelConfig

    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=61,
        max_seq_len=max_seq_len,
        n_layers=2,
        n_heads=4,
        d_model=32,
        init_std=0.3,
        tie_embeddings=False,
        **fields,
    )
    return GPT(cfg).eval()


# ---- a tiny `gptkit train` run and its corpus (test files write only what differs from these)
def write_corpus(folder, n_chars: int = 20_000, name: str = "corpus.txt") -> Path:
    """n_chars of the built-in corpus written at folder/name."""
    p = Path(folder) / name
    p.write_text(shakespeare(n_chars))
    return p


@pytest.fixture
def corpus(tmp_path) -> Path:
    """20,000 characters of the built-in corpus in the test's own folder (tmp_path/corpus.txt). A module whose
    tests only read their corpus shares one instead: `corpus = module_corpus(30_000)`."""
    return write_corpus(tmp_path)


def module_corpus(n_chars: int):
    """The `corpus` fixture at module scope, n_chars long (shakespeare-<n>k.txt in the module's own folder):
    assigned in a test file (`corpus = module_corpus(30_000)`), it replaces the per-test one there."""

    @pytest.fixture(scope="module", name="corpus")
    def _corpus(tmp_path_factory) -> Path:
        return write_corpus(tmp_path_factory.mktemp("corpus"), n_chars, f"shakespeare-{n_chars // 1000}k.txt")

    return _corpus


# tiny_run's keywords: keyword -> (the override's key, its default); a None value leaves the key out
TINY_RUN = {
    "model": ("model", "gpt2-tiny"),
    "layers": ("model.n_layers", 1),
    "d_model": ("model.d_model", 32),
    "heads": ("model.n_heads", 2),
    "kv_heads": ("model.n_kv_heads", None),
    "d_ff": ("model.d_ff", None),
    "seq_len": ("model.max_seq_len", 32),
    "dropout": ("model.dropout", None),
    "tokenizer": ("tokenizer", "char"),
    "data": ("data", "files"),
    "val_fraction": ("data.val_fraction", None),
    "batch_size": ("trainer.batch_size", 4),
    "steps": ("trainer.max_steps", 12),
    "val_every": ("trainer.val_every", 3),
    "val_windows": ("trainer.val_windows", 4),
    # by default, val_every's
    "checkpoint_every": ("trainer.checkpoint_every", "val_every"),
    "keep": ("trainer.keep_checkpoints", None),
    "log_every": ("trainer.log_every", 1),
    "progress": ("trainer.progress", "false"),
    "threads": ("trainer.threads", None),
    "accelerator": ("trainer.accelerator", None),
    "lr": ("optim.lr", None),
    "warmup": ("optim.warmup_steps", 2),
}


def tiny_run(corpus=None, runs=None, name=None, *extra: str, **keys) -> list[str]:
    """The overrides of a tiny `gptkit train` run: gpt2-tiny shrunk to 1 layer of width 32 (2 heads, 32
    positions), a char tokenizer on `corpus` (data=files), 12 steps of 4 windows, a validation and a
    checkpoint every 3 steps, a row per step, no progress line; then runs_dir=`runs`, name=`name` and `extra`
    (later overrides win). A keyword of TINY_RUN changes its default (`steps=6`); None leaves its key out;
    model=None leaves out every model key (a run started with init_from= or resume=)."""
    unknown = set(keys) - set(TINY_RUN)
    if unknown:
        raise TypeError(f"tiny_run: no keyword {sorted(unknown)}")
    values = {k: keys.get(k, default) for k, (_, default) in TINY_RUN.items()}
    if values["checkpoint_every"] == "val_every":
        values["checkpoint_every"] = values["val_every"]
    out = []
    for k, (key, _) in TINY_RUN.items():
        if values[k] is None or (values["model"] is None and key.startswith("model.")):
            continue
        out.append(f"{key}={values[k]}")
        if k == "data" and corpus is not None:
            out.append(f"data.paths=[{corpus}]")
    if runs is not None:
        out.append(f"runs_dir={runs}")
    if name is not None:
        out.append(f"name={name}")
    return [*out, *extra]


# what finetune_args changes in tiny_run: no model or tokenizer (init_from= brings them), 4 steps
FINETUNE_RUN = dict(
    model=None, tokenizer=None, val_fraction=0.1, steps=4, val_every=2, val_windows=2, checkpoint_every=2
)


def finetune_base(tmp_path_factory, name: str, **model) -> tuple[Path, Path]:
    """(a run folder holding a tiny Llama-style model, the frozen base of a fine-tuning; its corpus), in a
    folder of its own (for a module-scoped fixture: its tests only read it); `model` changes its config."""
    tmp = tmp_path_factory.mktemp(name)
    run, _, _ = make_run(tmp, max_seq_len=32, **model)
    return run, tmp / "corpus.txt"


def finetune_args(base, runs, name, *extra, finetune="lora", lora_dropout=None, **keys) -> list[str]:
    """`train` fine-tuning finetune_base's (run, corpus) with adapters of rank 4 on every projection
    (finetune=lora or qlora) for tiny_run's 4 steps of FINETUNE_RUN, one thread; keys change tiny_run's."""
    run, corpus = base
    lora = ["lora.targets=[q,k,v,o,gate,up,down]", "lora.rank=4"]
    if lora_dropout is not None:
        lora.append(f"lora.dropout={lora_dropout}")
    keys = {**FINETUNE_RUN, "threads": 1, "warmup": 1, **keys}
    return [
        "train",
        f"init_from={run}",
        f"finetune={finetune}",
        *lora,
        *tiny_run(corpus, runs, name, *extra, **keys),
    ]


# gdn-tiny shrunk (tiny_run's width 32, 2 layers): a Gated DeltaNet layer then a softmax one, 8-wide heads
HYBRID = ("model.layer_types=[linear,global]", "model.gdn.key_head_dim=8", "model.gdn.value_head_dim=8")
# the same layers for make_run (a ModelConfig's fields)
HYBRID_MODEL = dict(
    layer_types=["linear", "global"],
    gdn=dict(n_key_heads=2, n_value_heads=4, key_head_dim=8, value_head_dim=8),
)


def sft_start(root, sft, seq_len: int, hybrid: bool = False, name: str = "sft") -> Path:
    """root/<name>: 2 steps of data=chat (chatml, a byte tokenizer) on the records of `sft` from a tiny Llama
    (1 layer, no dropout; issue 49's attention sinks, output gate and partial RoPE, so that DPO and GRPO train
    them), the start of a DPO or GRPO run (tests/training/test_dpo.py, test_grpo.py); hybrid: HYBRID's two
    layers instead, a Gated DeltaNet layer first."""
    import gptkit

    model = dict(model="llama-tiny", kv_heads=1, d_ff=64, seq_len=seq_len, dropout=0.0)
    blocks = ("model.attn_sinks=true", "model.attn_output_gate=true", "model.rotary_dim=8")
    if hybrid:
        model.update(model="gdn-tiny", layers=2)
        # (gdn-tiny has no rotary_dim key: full RoPE in its softmax layer)
        blocks = (*HYBRID, *blocks[:2])
    keys = dict(tokenizer="byte", data="chat", steps=2, val_every=2, val_windows=2, checkpoint_every=None)
    run = dict(log_every=None, accelerator="cpu", warmup=None)
    gptkit.train(tiny_run(sft, root, name, "data.template=chatml", *blocks, **model, **keys, **run))
    return Path(root) / name


def from_sft(root, name, world: int, *extra) -> list[str]:
    """The trainer part of a DPO or GRPO run from root/sft: the same global batch (4) whatever the world size,
    6 steps, a validation and a checkpoint every 3 (3 windows, odd: on 2 ranks DistributedSampler repeats
    one, counted once), lr 1e-2, on the CPU; `extra` last."""
    keys = dict(model=None, tokenizer=None, data=None, batch_size=4 // world, steps=6, val_windows=3)
    return tiny_run(None, root, name, *extra, **keys, accelerator="cpu", lr="1e-2", warmup=1)


def write_jsonl(path, records) -> Path:
    """One JSON record a line at `path`."""
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# 2 processes on the CPU sharing the global batch of 4
TWO_CPU_RANKS = ("trainer.devices=2", "trainer.batch_size=2", "trainer.accelerator=cpu")


def resume_on_one_process(capsys, run) -> None:
    """`train resume=run` on one device with the global batch of 4 (a run of TWO_CPU_RANKS, its sharded
    checkpoint), which must succeed."""
    code, _, err = run_main(
        capsys,
        "train",
        f"resume={run}",
        "trainer.devices=1",
        "trainer.batch_size=4",
        "trainer.progress=false",
    )
    assert code == 0, err


def chat_train(f, runs, name: str) -> list[str]:
    """The overrides of `train` of llama-tiny (a byte tokenizer) on the chat records of f, chatml."""
    data = ["data=chat", f"data.paths=[{f}]", "data.template=chatml"]
    return ["model=llama-tiny", "tokenizer=byte", *data, f"runs_dir={runs}", f"name={name}"]


def estimate_plan(model_cfg, **more):
    """What gptkit.training.memory.estimate reads of a plan: `model_cfg` in fp32 on one device, 2 windows of
    16 tokens a step, no activation checkpointing, no LoRA (`more` adds or changes fields)."""
    from types import SimpleNamespace

    from gptkit.precision import precision

    trainer = SimpleNamespace(activation_checkpointing=False)
    fields = dict(
        precision=precision("32-true"), shards=1, batch_size=2, seq_len=16, trainer=trainer, lora=None
    )
    return SimpleNamespace(model=model_cfg, **fields, **more)


def tokenizer_settings(kind: str, tmp_path) -> dict:
    """A tokenizer of each kind (byte, char, bpe, a tokenizer.json no fast path knows) as settings."""
    if kind == "file":
        return {"kind": "file", "path": metaspace_tokenizer(tmp_path / "meta.json"), "eos_token": SAMPLE_EOS}
    return {
        "byte": {"kind": "byte", "eos_token": SAMPLE_EOS},
        "char": {"kind": "char", "eos_token": None},
        "bpe": {"kind": "bpe", "vocab_size": 400, "special_tokens": ["<|bos|>"]},
    }[kind]


# transformers' own way of marking what the assistant writes (a chat template with {% generation %})
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def trained(args, run) -> Path:
    """`gptkit train *args` (a subprocess) that must succeed; its run folder `run`."""
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def exports(capsys, *calls) -> str:
    """`gptkit export` (in process) with each list of arguments in `calls`, each to succeed: the last one's
    stdout."""
    for args in calls:
        code, out, err = run_main(capsys, "export", *args)
        assert code == 0, err
    return out


def main_code(*args: str) -> int:
    """gptkit.cli.main(args) in process: its exit code."""
    from gptkit.cli import main

    return main(list(args))


def tiny_model(**keys) -> list[str]:
    """tiny_run's model overrides alone (`model=gpt2-tiny`, `model.n_layers=1`, ...), its model keywords
    changing them."""
    return [o for o in tiny_run(**keys) if o.split("=")[0].split(".")[0] == "model"]


def timeless_rows(run) -> list[dict]:
    """A run folder's metrics.csv rows without the timings (perf/*), which differ from run to run."""
    import csv

    with open(Path(run) / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in csv.DictReader(f)]


def rows_by_step(run) -> dict[int, dict[str, str]]:
    """A run folder's metrics.csv: {step: its row}."""
    import csv

    with open(Path(run) / "metrics.csv", newline="") as f:
        return {int(r["step"]): r for r in csv.DictReader(f)}


# the end-of-text token of make_run's tokenizer
SAMPLE_EOS = "<|endoftext|>"


def make_run(tmp_path, *, position="rope", eos=True, n_chars=20_000, seed=0, max_seq_len=64, **model):
    """A run folder: a char tokenizer of the first n_chars of tinyshakespeare and a random tiny GPT (`model`:
    other ModelConfig fields).

    Its config.yaml holds data/tokenizer sections pointing at that text, as `train` writes them."""
    import torch

    from gptkit.model import GPT, ModelConfig
    from gptkit.runs import write_run_folder
    from gptkit.tokenizer import build_tokenizer

    corpus = write_corpus(tmp_path, n_chars)
    tok_cfg = {
        "kind": "char",
        "special_tokens": [],
        "eos_token": SAMPLE_EOS if eos else None,
        "unk_token": None,
    }
    tok = build_tokenizer(tok_cfg, texts=lambda: [corpus.read_text()])
    torch.manual_seed(seed)
    extra = dict(mlp="swiglu", norm="rmsnorm", bias=False, n_kv_heads=2) if position == "rope" else {}
    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        max_seq_len=max_seq_len,
        n_layers=2,
        n_heads=4,
        d_model=32,
        position=position,
        init_std=0.3,
        **extra,
        **model,
    )
    model = GPT(cfg).eval()
    config = {"data": {"kind": "files", "paths": [str(corpus)], "val_fraction": 0.1}, "tokenizer": tok_cfg}
    return write_run_folder(tmp_path / "run", config, model, tok), model, tok


def one_line_error(r, *needles):
    """A finished CLI process that failed with exit status 2 and one `error: ...` line holding the needles."""
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def refused_before_torch(refused: dict[tuple[str, ...], str]) -> None:
    """Each `gptkit train` override tuple of `refused` exits 2 with one `error: ` line holding its value, all
    in one fresh interpreter that imports neither torch nor Lightning (config_checks.py)."""
    import json

    code = (
        "import sys, io, contextlib, json\nfrom gptkit.cli import main\nlines = []\n"
        f"for args in {[['train', *a] for a in refused]!r}:\n"
        "    with contextlib.redirect_stderr(io.StringIO()) as err:\n"
        "        try:\n            main(args)\n"
        "        except SystemExit as e:\n            assert e.code == 2, e\n"
        "    lines.append(err.getvalue())\n"
        "print(json.dumps(lines))\n"
        "print('imported:', *(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    *_, lines, imported = r.stdout.strip().splitlines()
    assert imported.split() == ["imported:"], imported
    for err, want in zip(json.loads(lines), refused.values(), strict=True):
        assert err.startswith("error: ") and err.count("\n") == 1 and want in err, (err, want)


def big_vocab_tokenizer(path, n=70_000):
    """A word-level tokenizer.json of n entries (w0, w1, ...): a vocabulary beyond uint16."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(n)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def kernel_device() -> str:
    """Where the kernel tests run: CUDA when compiled kernels can run, else the CPU (the interpreter)."""
    import torch

    from gptkit_kernels import interpreting

    return "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


@contextlib.contextmanager
def poisoned_allocations():
    """Every torch.empty / empty_like / Tensor.new_empty made inside is NaN-filled (floats)."""
    import torch

    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    mp = pytest.MonkeyPatch()
    mp.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    mp.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))
    mp.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: poison(real_new_empty(self, *a, **kw)))
    try:
        yield
    finally:
        mp.undo()


def reference(q, k, v, causal, scale, dtype=None):
    """Eager attention in float64 (or in `dtype` with an fp32 softmax, as a plain torch user gets it):
    softmax(q k^T * scale) v, K/V repeated per query head."""
    import torch

    dtype = torch.float64 if dtype is None else dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [B, H, T, D]
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale  # [B, H, T, T]
    if causal:
        T = q.shape[2]
        causal_mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal_mask, float("-inf"))
    softmax_dtype = torch.float32 if dtype != torch.float64 else dtype
    return torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(dtype) @ v


# ---- shared by several rooms: Hugging Face models (tests/hf/ and the files that import or export), a
# process group, a one-line check
HF_TEXT = "To be, or not to be, that is the question"
# not a usual spelling: export must take it from the run config
HF_EOS = "<|doc|>"
HF_VARIANTS = {
    "llama-mha-tied-bias": dict(
        position="rope", mlp="swiglu", norm="rmsnorm", bias=True, tie_embeddings=True, rope_theta=500.0
    ),
    "llama-gqa-untied": dict(
        position="rope", mlp="swiglu", norm="rmsnorm", bias=False, tie_embeddings=False, n_kv_heads=2, d_ff=48
    ),
    "llama-mqa-head_dim": dict(
        position="rope",
        mlp="swiglu",
        norm="rmsnorm",
        bias=False,
        tie_embeddings=False,
        n_kv_heads=1,
        head_dim=16,
    ),
    "gpt2-tied": dict(position="learned", mlp="gelu", norm="layernorm", bias=True, tie_embeddings=True),
    "gpt2-untied": dict(
        position="learned", mlp="gelu", norm="layernorm", bias=True, tie_embeddings=False, d_ff=80
    ),
}


def char_tokenizer():
    """A character tokenizer with an end-of-text token (HF `tokenizers`, as a run folder holds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set(HF_TEXT + "abcdefghijklmnopqrstuvwxyz .,"))
    vocab = {c: i for i, c in enumerate(chars)}
    vocab[HF_EOS] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=HF_EOS))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([HF_EOS])
    return tok


def random_gpt(variant: str, vocab_size: int = 40, seed: int = 0):
    """A tiny GPT whose every weight (norms and biases included) is random, so no mapping error hides."""
    import torch

    from gptkit.model import GPT, ModelConfig

    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=vocab_size, max_seq_len=48, n_layers=2, n_heads=4, d_model=32, **HF_VARIANTS[variant]
    )
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def gptkit_greedy(model, ids, n: int, eos: int) -> list[int]:
    """Greedy continuation of ids [1, T] by `model`, n tokens at most, ending at `eos`."""
    import torch

    out = ids[0].tolist()
    for _ in range(n):
        with torch.no_grad():
            nxt = int(model(torch.tensor([out])).logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eos:
            break
    return out


def hf_llama(tie: bool, bias: bool):
    """A tiny transformers Llama (GQA), untrained weights."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=48,
        rope_theta=1000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        attention_bias=bias,
        mlp_bias=bias,
        bos_token_id=None,
        eos_token_id=None,
    )
    return transformers.LlamaForCausalLM(cfg)


def hf_gpt2(tie: bool):
    """A tiny transformers GPT-2, untrained weights."""
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=40,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=48,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=None,
    )
    return transformers.GPT2LMHeadModel(cfg)


# what the tiny transformers models of tests/hf/ share (test_hf_variants, test_hf_windows, test_hf_moe)
HF_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def hf_common(vocab_size: int, positions: int, **change) -> dict:
    """The config fields of a tiny transformers model (HF_COMMON), `change` changing them."""
    return dict(vocab_size=vocab_size, **HF_COMMON, max_position_embeddings=positions) | change


def hf_perturbed(build):
    """build() (a transformers model) under seed 0, every weight (norms and biases included) then moved by
    0.2 N(0, 1): no mapping error hides behind a weight left at its initial value."""
    import torch

    torch.manual_seed(0)
    model = build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def hf_import(tmp_path, theirs, want: dict):
    """`theirs` saved at tmp_path/hf and imported by `gptkit import` into tmp_path/run, whose model has the
    fields `want`: (its ModelConfig, its GPT)."""
    from gptkit.cli import main
    from gptkit.runs import load_model

    theirs.save_pretrained(tmp_path / "hf")
    assert main(["import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}"]) == 0
    _, _, _, model_cfg, model = load_model(tmp_path / "run")
    for k, v in want.items():
        assert getattr(model_cfg, k) == v, k
    return model_cfg, model


def hf_export_same_files(tmp_path, architecture: str, idx, ref, attention: str | None = None) -> None:
    """`gptkit export` of tmp_path/run into tmp_path/again: config.json names `architecture`, the safetensors
    are tmp_path/hf's bit for bit, and transformers loads them (with `attention`) into logits `ref` on idx."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file

    from gptkit.cli import main

    assert main(["export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'again'}"]) == 0
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["architectures"] == [architecture]
    original = load_file(tmp_path / "hf" / "model.safetensors")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(again) == sorted(original)
    for k, v in original.items():
        assert torch.equal(again[k], v), k
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    if attention is not None:
        reloaded.set_attn_implementation(attention)
    with torch.no_grad():
        assert (reloaded(idx).logits - ref).abs().max().item() == 0.0


def run_group(*argv: str, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    """Run a command in its own session; on timeout (or any error) kill the whole group, children included."""
    import signal

    env = dict(os.environ)
    env.pop("GPTKIT_VERB", None)
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            # ranks left behind, if any
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_two_ranks(script: str, tmp_path) -> None:
    """tests/training/<script> as ranks 0 and 1 of a 2-process job (its arguments: rank, 2, tmp_path/init,
    tmp_path), one thread each, tests/ on PYTHONPATH: both must exit 0."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, str(REPO / "tests" / "training" / script)]
    folders = [str(tmp_path / "init"), str(tmp_path)]
    ranks = [
        subprocess.Popen([*argv, str(r), "2", *folders], env=env, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        errors = [p.communicate(timeout=HANG_S)[1] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0], errors[0][-3000:] + errors[1][-3000:]


def one_line(err: str) -> bool:
    """One error line (notes and the data preparation's lines aside, as .ci/fault-loop counts), no
    traceback."""
    lines = [
        line
        for line in err.strip().splitlines()
        if line.strip()
        and not line.startswith(("note: ", "prepared ", "cache hit: ", "using prepared", "tokenizing"))
    ]
    return len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err


def log_prob_path(monkeypatch, chunk: int | None) -> list[int]:
    """Route the model's per-token log-probs (GPT.forward(token_logps=True), the seam gptkit.model.fused)
    through the chunked path with `chunk` rows per chunk, or, with chunk None, through the unchunked one the
    objectives used before: whole logits (lm_head, soft cap), .float() / temperature, F.cross_entropy. Returns
    the list each call appends its token count to."""
    import torch
    import torch.nn.functional as F

    import gptkit.model.fused as seam
    from gptkit_kernels.linear_ce import linear_log_probs

    calls: list[int] = []

    def chunked(x, weight, targets, softcap=None, temperature=1.0):
        calls.append(targets.numel())
        return linear_log_probs(
            x, weight, targets, chunk_size=chunk, softcap=softcap, temperature=temperature
        )

    def whole(x, weight, targets, softcap=None, temperature=1.0):
        calls.append(targets.numel())
        logits = F.linear(x, weight)  # [N, T, V]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits.float() / temperature
        v = logits.shape[-1]
        out = F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1), ignore_index=-100, reduction="none")
        return -out.view(targets.shape)

    monkeypatch.setattr(seam, "linear_log_probs", whole if chunk is None else chunked)
    return calls


def policy_and_reference(seed: int = 0):
    """A tiny policy and a reference of other weights (so the rewards are not 0), fp32: T = 20 positions,
    chunked 7 rows at a time (chunks straddle the rows)."""
    import torch

    from gptkit.model import GPT, ModelConfig
    from gptkit.training.objectives import FrozenModel

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=96, max_seq_len=24, n_layers=1, n_heads=2, d_model=32, logit_softcap=5.0)
    policy, reference = GPT(cfg), GPT(cfg)
    with torch.no_grad():
        for p in (*policy.parameters(), *reference.parameters()):
            p.add_(0.3 * torch.randn_like(p))
    return policy, FrozenModel(reference)


def answer_rows(n: int, seed: int = 1):
    """x, y [n, 20]: y -100 but on a stretch of answer tokens of another length in each row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 96, (n, 20), generator=g)
    y = torch.randint(0, 96, (n, 20), generator=g)
    for i in range(n):
        y[i, : 3 + i] = -100
        y[i, 20 - i % 3 :] = -100
    return x, y


def loss_and_grads(objective_loss, policy, monkeypatch, chunk):
    """(loss, {name: gradient}) of objective_loss(policy) with the log-probs chunked `chunk` rows at a time,
    or unchunked (chunk None)."""
    calls = log_prob_path(monkeypatch, chunk)
    policy.zero_grad(set_to_none=True)
    loss = objective_loss(policy)
    loss.backward()
    assert calls, "the objective did not read the model's per-token log-probs"
    return loss.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}


def assert_same(a, b):
    """Two (loss, gradients) equal to 1e-6."""
    import torch

    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ---- chat templates with tool syntax (tests/data/test_chat_data.py, tests/serve/test_serve.py) -----
from gptkit import chat_templates as _chat_templates  # noqa: E402

# The tool syntax of Qwen2.5's and Llama 3.1's templates (tools in the system message / the first user
# message, <tool_call> JSON / a {"name", "parameters"} reply, <tool_response> in a user turn / an ipython
# turn), written here: the models' files cannot be downloaded offline.
QWEN25_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nReturn each call within <tool_call></tool_call> XML tags.<|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
        or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
LLAMA31_TOOLS = """{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if not tools is none %}
    {%- set first_user_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
        + 'value}.' }}
    {{- "\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
# Qwen3's differences: a call's arguments written as they are when a string (else | tojson), and an
# assistant's content cut after its last </think> (which sends text-is-data to its fallback)
QWEN3_TOOLS = QWEN25_TOOLS.replace(
    "{{- tool_call.arguments | tojson }}",
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}",
).replace(
    "{%- if message.content %}\n            {{- '\\n' + message.content }}",
    "{%- set content = message.content %}{%- if '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if content %}\n            {{- '\\n' + content }}",
)
assert QWEN3_TOOLS.count("is string") == 1 and QWEN3_TOOLS.count("</think>") == 2
TOOL_TEMPLATES = {
    "qwen2.5": (QWEN25_TOOLS, {}, ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]),
    "qwen3": (QWEN3_TOOLS, {}, ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]),
    "llama3.1": (LLAMA31_TOOLS, {"bos_token": "<|begin_of_text|>"}, _chat_templates.BUILTIN["llama3"][1]),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
