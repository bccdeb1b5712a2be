"""`gptkit bench memory`: the activation-memory levers side by side (conf/bench/memory.yaml;
docs/parallelism.md#memory-levers). One model, one batch, one process; for each case

    none                       every activation kept (the plain step)
    full                       trainer.activation_checkpointing=full: each block recomputed
    selective ops k            torchtitan's op policy: matmul and attention outputs kept, every k-th matmul
                               and the rest recomputed
    selective attention        the attention core's outputs kept, the rest recomputed
    selective layers k         every k-th block recomputed whole
    offload                    trainer.activation_offload: the blocks' saved activations to host memory

one forward and backward from the same weights: what the forward leaves alive for the backward ("kept") and
the step's peak above what was alive before it, both from the CPU allocator's own records
(training/activations.py step_memory), their ratios to the plain step's, the count-params estimate's ratio
of its activations (accounting.training_memory), the loss and the largest gradient difference from the plain
step, and the median seconds of `repeats` steps. On the CPU the activations are in host memory already:
offload moves nothing there, and its row gives the bytes its hook would move on a GPU (counted, not
measured) next to the same kept and peak as the plain step.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from gptkit import accounting
from gptkit.bench.measure import loadavg
from gptkit.conf_files import conf_dir
from gptkit.errors import ConfigError
from gptkit.fsio import human_bytes
from gptkit.model import GPT, ModelConfig
from gptkit.threads import set_threads
from gptkit.training import activations


def cases(every: int) -> dict[str, dict]:
    """Each case's apply() settings, and its estimate's."""
    return {
        "none": dict(mode=None),
        "full": dict(mode="full"),
        f"selective ops {every}": dict(mode="selective", policy="ops", every=every),
        "selective attention": dict(mode="selective", policy="attention", every=every),
        f"selective layers {every}": dict(mode="selective", policy="layers", every=every),
        "offload": dict(mode=None, offload=True),
    }


def model_config(cfg) -> ModelConfig:
    preset = OmegaConf.load(conf_dir() / "model" / f"{cfg.model}.yaml")
    fields = {**OmegaConf.to_container(preset, resolve=True), **dict(cfg.model_overrides or {})}
    return ModelConfig.from_dict(fields)


def run(cfg) -> int:
    for key in ("batch_size", "seq_len", "every", "repeats"):
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ConfigError(f"bench.{key}={cfg[key]} must be an integer >= 1")
    set_threads(cfg.threads, "bench.threads")
    model_cfg = model_config(cfg)
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(
            f"bench.seq_len={cfg.seq_len} is more than model.max_seq_len={model_cfg.max_seq_len}"
        )
    torch.manual_seed(int(cfg.seed))
    state = GPT(model_cfg).state_dict()
    x = torch.randint(0, model_cfg.vocab_size, (cfg.batch_size, cfg.seq_len))
    y = torch.randint(0, model_cfg.vocab_size, (cfg.batch_size, cfg.seq_len))
    load_before = loadavg()
    rows, plain, plain_grads = [], None, None
    for name, kw in cases(int(cfg.every)).items():
        model = GPT(model_cfg)
        model.load_state_dict(state)
        counts = activations.apply(model, **kw)
        mem = activations.step_memory(lambda: model(x, y).loss)
        # of this one step (the timed ones add to the counts)
        on_host = counts["on_host"]
        grads = [p.grad.clone() for p in model.parameters()]
        seconds = []
        for _ in range(int(cfg.repeats)):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            model(x, y).loss.backward()
            seconds.append(time.perf_counter() - t0)
        est = accounting.training_memory(
            model_cfg,
            "32-true",
            1,
            cfg.batch_size,
            cfg.seq_len,
            kw["mode"],
            checkpointing_policy=kw.get("policy", "ops"),
            checkpointing_every=kw.get("every", 2),
        )
        if plain is None:
            plain, plain_grads, plain_est = mem, grads, est
        rows.append(
            {
                "case": name,
                "kept": mem["kept"],
                "kept_ratio": mem["kept"] / plain["kept"],
                "peak": mem["peak"],
                "peak_ratio": mem["peak"] / plain["peak"],
                "estimate_ratio": (est["activations"] + est["logits"])
                / (plain_est["activations"] + plain_est["logits"]),
                "loss": mem["loss"],
                "loss_diff": abs(mem["loss"] - plain["loss"]),
                "grad_max_diff": max(float((a - b).abs().max()) for a, b in zip(grads, plain_grads)),
                "seconds": statistics.median(seconds),
                "offload_bytes_on_host": on_host,
            }
        )
    load_after = loadavg()
    t = Table(
        title=f"gptkit bench memory: {model_cfg.name} ({model_cfg.n_layers} layers, d_model "
        f"{model_cfg.d_model}), "
        f"batch {cfg.batch_size} x {cfg.seq_len} tokens, fp32, CPU, {cfg.threads} thread(s)"
    )
    for c in (
        "case",
        "kept",
        "x none",
        "peak",
        "x none",
        "estimate x none",
        "loss diff",
        "grad max diff",
        "s/step",
    ):
        t.add_column(c, justify="left" if c == "case" else "right")
    for r in rows:
        t.add_row(
            r["case"],
            human_bytes(r["kept"]),
            f"{r['kept_ratio']:.3f}",
            human_bytes(r["peak"]),
            f"{r['peak_ratio']:.3f}",
            f"{r['estimate_ratio']:.3f}",
            f"{r['loss_diff']:.1e}",
            f"{r['grad_max_diff']:.1e}",
            f"{r['seconds']:.3f}",
        )
    Console(width=150).print(t)
    off = next(r for r in rows if r["case"] == "offload")
    print(
        f"offload: its hook would move {human_bytes(off['offload_bytes_on_host'])} of activations (each "
        f"storage once) to the host on a GPU (counted; on the CPU they are on the host already and nothing "
        f"moves); load "
        f"{load_before} before, {load_after} after",
        file=sys.stderr,
    )
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump({"rows": rows, "load_before": load_before, "load_after": load_after}, f, indent=2)
    return 0
