"""The code paths a GPU run takes, taken on the CPU: every precision x clipping x fused AdamW x compile,
correct clipping with a fused optimizer, and a hot path with no host sync between log steps.

Each case is a real Lightning fit of a tiny model built by gptkit's own trainer factory (in-process, a few
steps), so a combination that Lightning or torch refuses fails here, not on the first GPU run.
"""

import csv
import itertools
import logging
import warnings

import pytest
import torch
from conftest import REPO, tiny_run
from omegaconf import OmegaConf
from torch.overrides import TorchFunctionMode

from gptkit.conf_tree import compose
from gptkit.data import TokenDataModule, prepare
from gptkit.errors import ConfigError
from gptkit.model import ModelConfig
from gptkit.precision import PRECISIONS
from gptkit.training.module import LitGPT
from gptkit.training.plan import make_plan
from gptkit.training.trainer import ClippingMixedPrecision, build_trainer, check_trainer_config

# the matrix; 16-true below
TRAINING_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
SEQ, BATCH = 16, 2


@pytest.fixture(scope="module")
def prepared():
    return prepare({"kind": "shakespeare"}, {"kind": "byte"}, progress=False)


@pytest.fixture(scope="module")
def base_cfg():
    return compose(
        "train",
        [
            "model.n_layers=2",
            "model.d_model=32",
            "model.n_heads=2",
            f"model.max_seq_len={SEQ}",
            "model.vocab_size=256",
            f"trainer.batch_size={BATCH}",
            "trainer.progress=off",
            "trainer.val_every=1000",
            "trainer.checkpoint_every=1000",
        ],
    )


def fit(prepared, base_cfg, tmp_path, steps=3, seed=0, **trainer_opts):
    """A short fit through build_trainer; returns (module, trainer). optim.fused=... via fused=."""
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    cfg = OmegaConf.create(OmegaConf.to_container(base_cfg, resolve=True))
    cfg.optim.fused = trainer_opts.pop("fused", "auto")
    cfg.optim.warmup_steps = 0
    for k, v in trainer_opts.items():
        cfg.trainer[k] = v
    cfg.trainer.max_steps = steps
    check_trainer_config(cfg.trainer)
    torch.manual_seed(seed)
    plan = make_plan(cfg, tmp_path, ModelConfig.from_dict(OmegaConf.to_container(cfg.model)))
    accumulation = cfg.trainer.accumulate_grad_batches
    assert (plan.seq_len, plan.tokens_per_step, plan.max_steps) == (SEQ, BATCH * SEQ * accumulation, steps)
    module = LitGPT(plan)
    dm = TokenDataModule(prepared, batch_size=BATCH, seq_len=SEQ, seed=1, val_windows=2)
    trainer, _, metrics = build_trainer(plan, [])
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == steps
    return module, trainer, metrics


# compile: aot_eager traces and differentiates the graph as inductor does, without generating code
MATRIX = list(itertools.product(TRAINING_PRECISIONS, (1.0, None), ("auto", True, False), (False, True)))


@pytest.mark.parametrize(
    "precision, clip, fused, compile",
    MATRIX,
    ids=[f"{p}-clip{c}-fused{f}-compile{k}" for p, c, f, k in MATRIX],
)
def test_every_combination_trains(prepared, base_cfg, tmp_path, precision, clip, fused, compile):
    module, trainer, metrics = fit(
        prepared,
        base_cfg,
        tmp_path,
        precision=precision,
        gradient_clip_val=clip,
        fused=fused,
        compile=compile,
        compile_backend="aot_eager",
        log_every=3,
    )
    assert torch.isfinite(torch.tensor(metrics.last["train/loss"]))
    opt = trainer.optimizers[0]
    # auto picks fused on the CPU too, as on CUDA
    assert opt.defaults["fused"] == (fused in ("auto", True))
    # our plugin, with fp16 kept on the CPU (Lightning would switch to bf16)
    if PRECISIONS[precision].mixed:
        assert isinstance(trainer.precision_plugin, ClippingMixedPrecision)
        assert trainer.precision_plugin.precision == precision
        assert (trainer.precision_plugin.scaler is not None) == (precision == "16-mixed")


@pytest.mark.parametrize("precision", TRAINING_PRECISIONS)
def test_inductor_compile_trains(prepared, base_cfg, tmp_path, precision):
    _, _, metrics = fit(prepared, base_cfg, tmp_path, precision=precision, compile=True, log_every=3)
    assert torch.isfinite(torch.tensor(metrics.last["train/loss"]))


# issue 49's attention blocks on llama-tiny: sinks, the output gate, a window, a NoPE layer, partial RoPE
NEW_BLOCKS = [
    "model=llama-tiny",
    "model.n_kv_heads=1",
    "model.d_ff=64",
    "model.attn_sinks=true",
    "model.attn_output_gate=true",
    "model.sliding_window=8",
    "model.layer_types=[local,global]",
    "model.nope_layers=[1]",
    "model.rotary_dim=8",
]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_compile_trains_the_new_blocks_as_eager_mode_does(prepared, base_cfg, tmp_path, attention):
    """trainer.compile=true on a model with sinks, the output gate, windows, NoPE and partial RoPE: the same
    losses as without compile (aot_eager traces and differentiates the graph as inductor does)."""
    cfg = compose("train", [*NEW_BLOCKS, f"model.attention={attention}"])
    cfg.trainer, cfg.model.vocab_size = base_cfg.trainer, 256
    for k in ("n_layers", "d_model", "n_heads", "max_seq_len"):
        cfg.model[k] = base_cfg.model[k]
    runs = {}
    for compiled in (False, True):
        module, _, metrics = fit(
            prepared, cfg, tmp_path, compile=compiled, compile_backend="aot_eager", log_every=1, fused=False
        )
        weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
        runs[compiled] = metrics.last["train/loss"], weights
    (loss, trained), (compiled_loss, compiled) = runs[False], runs[True]
    assert compiled_loss == pytest.approx(loss, abs=1e-5)
    # the sinks and the gate trained (from 0 and their init), the same way compiled
    assert trained["blocks.0.attn.sinks"].abs().max() > 0
    for k, v in trained.items():
        assert torch.allclose(compiled[k], v, atol=1e-5), k


@pytest.mark.long
def test_mla_with_mtp_compiles_and_trains_under_eager_and_sdpa(prepared, base_cfg, tmp_path):
    """Multi-head latent attention (q of low rank, values narrower than the keys) and a multi-token
    prediction depth through torch.compile (aot_eager: inductor's trace and autograd), with each attention
    backend: the same losses."""
    losses = {}
    for attention in ("eager", "sdpa"):
        cfg = compose(
            "train",
            [
                "model=mla-tiny",
                *[
                    f"model.{k}={v}"
                    for k, v in base_cfg.model.items()
                    if k in ("n_layers", "d_model", "n_heads")
                ],
                f"model.max_seq_len={SEQ}",
                "model.vocab_size=256",
                "model.mla={q_lora_rank: 16, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, "
                "v_head_dim: 8}",
                "model.mtp={depth: 1, loss_scale: 0.3}",
                f"model.attention={attention}",
                f"trainer.batch_size={BATCH}",
                "trainer.progress=off",
                "trainer.val_every=1000",
                "trainer.checkpoint_every=1000",
            ],
        )
        _, _, metrics = fit(
            prepared, cfg, tmp_path / attention, 2, compile=True, compile_backend="aot_eager", log_every=2
        )
        losses[attention] = (metrics.last["train/loss"], metrics.last["train/mtp_loss_1"])
    assert all(torch.isfinite(torch.tensor(v)).all() for v in losses.values())
    torch.testing.assert_close(torch.tensor(losses["eager"]), torch.tensor(losses["sdpa"]), atol=1e-4, rtol=0)


def test_sixteen_true_trains(prepared, base_cfg, tmp_path):
    _, _, metrics = fit(prepared, base_cfg, tmp_path, precision="16-true", log_every=3)
    assert torch.isfinite(torch.tensor(metrics.last["train/loss"]))


@pytest.mark.parametrize("precision, tol", [("32-true", 1e-5), ("bf16-mixed", 1e-4), ("16-mixed", 1e-4)])
def test_clipping_with_the_fused_optimizer_is_the_same_clipping(prepared, base_cfg, tmp_path, precision, tol):
    """Fused AdamW takes the loss scale into its own step: clipping must act on the unscaled gradients, as
    with foreach. A tiny clip value makes every step clip."""
    weights = {}
    for fused in (True, False):
        module, _, _ = fit(
            prepared,
            base_cfg,
            tmp_path / str(fused),
            steps=2,
            precision=precision,
            gradient_clip_val=1e-3,
            fused=fused,
            log_every=2,
        )
        weights[fused] = {k: v.detach().float().clone() for k, v in module.model.state_dict().items()}
    for k in weights[True]:
        torch.testing.assert_close(weights[True][k], weights[False][k], rtol=tol, atol=tol, msg=k)


class SyncCounter(TorchFunctionMode):
    """Records each tensor-to-host read (what would make the host wait for the GPU) and the step it ran in."""

    SYNCS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__"}

    def __init__(self) -> None:
        super().__init__()
        self.trainer = None
        self.steps: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.SYNCS and self.trainer is not None:
            self.steps.append(self.trainer.global_step)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "precision, accumulation", [("32-true", 1), ("bf16-mixed", 1), ("16-mixed", 1), ("16-mixed", 2)]
)
def test_no_host_sync_between_log_steps(prepared, base_cfg, tmp_path, precision, accumulation):
    """Between log steps (here 4, 8 and the last, 10) nothing reads a tensor: no NaN check, no loss, no
    progress display, no GradScaler .item(), no token count of the step (accumulation 2: TokenMean). Steps
    1-3, 5-7 and 9 must have no sync at all."""
    counter = SyncCounter()
    original = LitGPT.on_train_start

    def start_counting(module):
        counter.trainer = module.trainer
        original(module)

    LitGPT.on_train_start = start_counting
    try:
        with counter:
            fit(
                prepared,
                base_cfg,
                tmp_path,
                steps=10,
                precision=precision,
                gradient_clip_val=1.0,
                log_every=4,
                progress="lines",
                accumulate_grad_batches=accumulation,
            )
    finally:
        LitGPT.on_train_start = original
    assert counter.steps, "the counter saw nothing: it does not observe the run"
    assert set(counter.steps) <= {0, 4, 8, 10}, sorted(set(counter.steps))


def test_a_nan_stops_at_the_next_log_step_and_no_checkpoint_holds_it(prepared, base_cfg, tmp_path):
    from gptkit.training.metrics import NonFiniteLossError

    original = LitGPT.training_step

    # LitGPT.training_step with a NaN loss at step 5
    def poisoned(module, batch, batch_idx):
        x, y = batch
        loss = module.model(x, y).loss
        if module.global_step == 5:
            loss = loss * float("nan")
        module.loss_window.add(loss, module.global_step)
        return loss

    LitGPT.training_step = poisoned
    try:
        with pytest.raises(NonFiniteLossError, match="non-finite at step 5"):
            fit(prepared, base_cfg, tmp_path, steps=12, log_every=4, checkpoint_every=6)
    finally:
        LitGPT.training_step = original
    # checked before the save at step 6
    assert not (tmp_path / "checkpoints" / "step-000006.ckpt").exists()


def test_batches_are_pinned_for_a_gpu(prepared):
    """On CUDA the batches come from pinned memory, so Lightning's non_blocking copy overlaps the step."""
    from types import SimpleNamespace

    dm = TokenDataModule(prepared, batch_size=BATCH, seq_len=SEQ, seed=1, val_windows=2)
    for device, pinned in (("cuda", True), ("cpu", False)):
        dm.trainer = SimpleNamespace(
            strategy=SimpleNamespace(root_device=torch.device(device)),
            global_step=0,
            accumulate_grad_batches=1,
            global_rank=0,
            world_size=1,
        )
        assert dm.train_dataloader().pin_memory is pinned
        assert dm.val_dataloader().pin_memory is pinned


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true"])
def test_bench_train_compares_the_two_loops(tmp_path, precision):
    """`gptkit bench train` runs both loops (the GPU path's GradScaler / dtype branches included) and
    writes a row per compile setting."""
    import json

    from gptkit.cli import main

    out = tmp_path / "train.json"
    rc = main(
        [
            "bench",
            "train",
            "device=cpu",
            f"precision={precision}",
            "steps=3",
            "warmup=1",
            "repeats=1",
            "log_every=2",
            "compile=[false]",
            "model_overrides={max_seq_len: 16, n_layers: 1, n_heads: 2, d_model: 32}",
            "batch_size=2",
            f"out={out}",
        ]
    )
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["precision"] == precision and [r["compile"] for r in d["rows"]] == ["off"]
    assert d["rows"][0]["gptkit_ms"] > 0 and d["rows"][0]["bare_ms"] > 0


def test_bench_compare_trains_the_variants_side_by_side_and_reads_finished_runs(
    corpus, tmp_path, capsys, monkeypatch
):
    """`gptkit bench compare`: every variant on every seed, each a `gptkit train` of the shared arguments plus
    its own (here in this process, not a process of its own); the table and JSON give each its final val loss
    and its seconds over the baseline's run of the same seed (the baseline's ratios 1); a second call reads
    the finished runs instead of training them."""
    import json

    import gptkit
    from gptkit.bench import compare, optim

    monkeypatch.setattr(optim, "run_one", lambda args, log: gptkit.train(args))

    model = tiny_run(corpus, model="llama-tiny", d_ff=64, steps=2, val_every=2, val_windows=2, warmup=1)
    cfg = OmegaConf.load(REPO / "conf/bench/compare.yaml")
    # (parallel=1: in one process, one run at a time)
    cfg.model, cfg.common, cfg.seeds, cfg.parallel = [*model, "trainer.accelerator=cpu"], [], [1], 1
    cfg.runs_dir, cfg.out = str(tmp_path / "runs"), str(tmp_path / "out.json")
    assert compare.run(cfg) == 0
    out = capsys.readouterr().out
    assert "2 run(s) to train, 1 at a time" in out and "no-sinks" in out
    for variant, sinks in (("no-sinks", False), ("sinks", True)):
        assert OmegaConf.load(tmp_path / f"runs/{variant}-seed1/config.yaml").model.attn_sinks is sinks
    got = json.loads((tmp_path / "out.json").read_text())
    assert set(got["results"]) == {"no-sinks", "sinks"} and got["seeds"] == [1]
    base, sinks = got["results"]["no-sinks"], got["results"]["sinks"]
    assert base["wall_ratio"]["median"] == 1.0 and base["steps"] == sinks["steps"] == 2
    # each run's peak memory as it logged it (perf/memory_peak, at step 2)
    rows = list(csv.DictReader(open(tmp_path / "runs/sinks-seed1/metrics.csv")))
    logged = [float(r["perf/memory_peak"]) for r in rows if r.get("perf/memory_peak")]
    assert sinks["memory_peak"]["median"] == logged[-1] > 0
    # timings are reported, never judged here (the ratio's value is the machine's)
    assert "median" in sinks["wall_ratio"]
    assert 0 < sinks["final_val_loss"]["median"] < 10
    assert compare.run(cfg) == 0
    assert "0 run(s) to train" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["results"] == got["results"]
    cfg.baseline = "none"
    with pytest.raises(ConfigError, match="bench.baseline='none' is not one of bench.variants"):
        compare.run(cfg)


def test_bench_long_context_compares_the_variants_per_context_and_counts_the_cache(
    corpus, tmp_path, capsys, monkeypatch
):
    """`gptkit bench long-context`: per context, `bench compare` of the hybrid and the all-softmax model (each
    run a window of T tokens, model.max_seq_len=T), then each variant's first-seed run decoded at T and its
    cache bytes at T: by the cache layout, equal to the tensors a KVCache allocates, here checked against the
    arithmetic (4 softmax layers' K and V; 1 layer's K and V + 3 Gated DeltaNet states). Bad contexts are one
    ConfigError."""
    import json

    import gptkit
    from gptkit.bench import long_context, optim

    monkeypatch.setattr(optim, "run_one", lambda args, log: gptkit.train(args))
    model = tiny_run(
        corpus, model="gdn-tiny", layers=None, d_model=None, heads=None, seq_len=None, warmup=None
    )
    cfg = OmegaConf.load(REPO / "conf/bench/long-context.yaml")
    cfg.model, cfg.common, cfg.seeds, cfg.parallel = [*model, "trainer.accelerator=cpu"], [], [1], 1
    cfg.contexts = [{"context": 96, "steps": 2, "warmup_steps": 1, "val_windows": 1}]
    cfg.decode_steps, cfg.decode_repeats = 4, 1
    cfg.runs_dir, cfg.out = str(tmp_path / "runs"), str(tmp_path / "out.json")
    assert long_context.run(cfg) == 0
    assert "2 run(s) to train, 1 at a time" in capsys.readouterr().out
    for variant, types in (("softmax", ["global"] * 4), ("hybrid", ["linear"] * 3 + ["global"])):
        run_cfg = OmegaConf.load(tmp_path / f"runs/ctx96/{variant}-seed1/config.yaml")
        assert list(run_cfg.model.layer_types) == types and run_cfg.model.max_seq_len == 96
    (ctx,) = json.loads((tmp_path / "out.json").read_text())["contexts"]
    assert ctx["context"] == 96 and set(ctx["train"]) == {"softmax", "hybrid"}
    assert ctx["train"]["softmax"]["wall_ratio"]["median"] == 1.0 and ctx["train"]["hybrid"]["steps"] == 2
    assert ctx["train"]["hybrid"]["memory_peak"]["median"] > 0
    soft, hyb = ctx["decode"]["softmax"], ctx["decode"]["hybrid"]
    kv_layer = 2 * 2 * 32 * 96 * 4  # K and V, 2 KV heads of 32, 96 positions, fp32
    # [H_v, d_k, d_v] + the conv's last 3 inputs of q, k (2 heads of 32 each) and v (4 of 32), fp32
    state = (4 * 32 * 32 + (2 * 2 * 32 + 4 * 32) * 3) * 4
    assert soft["cache_bytes_layout"] == soft["cache_bytes_allocated"] == 4 * kv_layer
    assert hyb["cache_bytes_layout"] == hyb["cache_bytes_allocated"] == kv_layer + 3 * state
    assert soft["tokens_per_s"]["median"] > 0 and hyb["tokens_per_s"]["median"] > 0
    assert long_context.run(cfg) == 0
    assert "0 run(s) to train" in capsys.readouterr().out
    cfg.contexts = [{"context": 96, "steps": 2, "warmup_steps": 2, "val_windows": 1}]
    with pytest.raises(ConfigError, match="has warmup_steps >= steps"):
        long_context.run(cfg)
    cfg.contexts = [{"context": 96, "steps": 2}]
    with pytest.raises(ConfigError, match="give each as"):
        long_context.run(cfg)


def test_out_of_memory_names_the_estimate_and_the_fixes(base_cfg):
    from gptkit.training.report import out_of_memory

    cfg = OmegaConf.create(OmegaConf.to_container(base_cfg, resolve=True))
    err = str(out_of_memory(make_plan(cfg, None, ModelConfig.from_dict(OmegaConf.to_container(cfg.model)))))
    assert err.startswith("out of GPU memory: count-params estimates ") and "\n" not in err
    for fix in ("trainer.batch_size", "trainer.activation_checkpointing=true", "trainer=fsdp"):
        assert fix in err
