"""The checks of a training config that need neither torch nor Lightning: values, choices, combinations.

fit.check_config runs check_values first, so that a refused value is one line after 0.28 s of CPU instead
of the 5.3 s it cost with torch and Lightning imported first (`gptkit train trainer.precision=fp9`, issue
47 item 12; docs/benchmarks.md). What needs torch (the accelerator, the devices, bf16 on this GPU,
torch.compile, Muon in this torch), an optional package (lm-eval) or the classes of the fine-tunes and
objectives is checked after it (trainer.check_trainer_config, fit.check_config). This module imports nothing
of torch, Lightning or the training modules that do (tests/front/test_cli_strict.py checks that a refused
config imports neither).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import OmegaConf

from gptkit.conf_tree import count
from gptkit.errors import ConfigError
from gptkit.extras import require
from gptkit.model.config import ModelConfig
from gptkit.precision import Precision, precision
from gptkit.threads import check_threads
from gptkit.training.progress import progress_mode

COMPILE_MODES = ("blocks", "model")
SCHEDULES = ("cosine", "linear", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon")
# where torch's fused AdamW kernel runs (torch >= 2.4 on the CPU)
FUSED_DEVICES = ("cuda", "cpu")
# trainer.activation_checkpointing and its selective policies (training/activations.py)
CHECKPOINTING = ("none", "false", "true", "full", "selective")
CHECKPOINTING_POLICIES = ("ops", "attention", "layers")
# the loggers whose package is optional: each is a row of gptkit.extras.EXTRAS
LOGGER_PACKAGES = ("tensorboard", "wandb")


@dataclass(frozen=True)
class Values:
    """What check_values derived, each once: the trainer's precision and compile mode and, for a new model
    (neither resume= nor init_from=), its config."""

    precision: Precision
    # None | "blocks" | "model"
    compile: Optional[str]
    model: Optional[ModelConfig] = None


def check_values(cfg: Any, new_model: bool) -> Values:
    """The `trainer`, `optim`, `logger` and (new_model: the run builds its model from model=) `model`
    groups' values, one-line ConfigErrors."""
    values = check_trainer_values(cfg.trainer)
    check_optim_values(cfg.optim)
    check_loggers(cfg.logger)
    if new_model:
        model = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
        values = Values(values.precision, values.compile, model)
        check_tensor_parallel_model(cfg, model)
    check_context_parallel(cfg.trainer, values.model, values.compile)
    check_mesh_shape(cfg.trainer)
    if int(cfg.trainer.get("context_parallel") or 1) > 1 and str(cfg.get("objective", "lm")) != "lm":
        raise ConfigError(
            f"trainer.context_parallel splits the sequences of objective=lm only, not "
            f"objective={cfg.objective}"
        )
    return values


def check_trainer_values(t: Any) -> Values:
    """The `trainer` group's values: counts, intervals, precision, compile mode (one line each)."""
    for key in (
        "batch_size",
        "accumulate_grad_batches",
        "val_every",
        "checkpoint_every",
        "log_every",
        "num_nodes",
    ):
        if not isinstance(t[key], int) or int(t[key]) < 1:
            raise ConfigError(f"trainer.{key}={t[key]} must be an integer >= 1")
    if t.max_tokens is None and (not isinstance(t.max_steps, int) or t.max_steps < 1):
        raise ConfigError(
            f"trainer.max_steps={t.max_steps} must be an integer >= 1 (or set trainer.max_tokens)"
        )
    if t.max_tokens is not None:
        count(t.max_tokens, "trainer.max_tokens")
    seq_len = t.get("seq_len")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ConfigError(
            f"trainer.seq_len={seq_len} must be an integer >= 1 (or null for model.max_seq_len)"
        )
    check_threads(t.get("threads"), "trainer.threads")
    if t.val_windows is not None and int(t.val_windows) < 1:
        raise ConfigError(f"trainer.val_windows={t.val_windows} must be >= 1 (or null for every window)")
    keep = t.get("keep_checkpoints", 3)
    if keep is not None and (not isinstance(keep, int) or keep < 0):
        raise ConfigError(
            f"trainer.keep_checkpoints={keep} must be an integer >= 0 (or null to keep every one)"
        )
    every = t.get("sample_every")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ConfigError(f"trainer.sample_every={every} must be an integer >= 1 (or null for no samples)")
    if not isinstance(t.get("keep_best", False), bool):
        raise ConfigError(f"trainer.keep_best={t.keep_best} must be true or false")
    if t.gradient_clip_val is not None and float(t.gradient_clip_val) <= 0:
        raise ConfigError(
            f"trainer.gradient_clip_val={t.gradient_clip_val} must be > 0 (or null for no clipping)"
        )
    check_ema(t.get("ema"), str(t.get("strategy", "auto")))
    checkpointing_mode(t)
    check_tensor_parallel(t)
    progress_mode(t.progress)
    check_launcher(t)
    return Values(precision=precision(t.precision), compile=compile_mode(t.compile))


def checkpointing_mode(t: Any) -> str | None:
    """trainer.activation_checkpointing as None (off), "full" (true, full) or "selective", its policy, every
    and trainer.activation_offload checked (one line each)."""
    if not hasattr(t, "get"):
        # a plan-like namespace (tests, bench)
        t = vars(t)
    value = t.get("activation_checkpointing", False)
    mode = str(value).lower() if isinstance(value, (bool, str)) else None
    if mode not in CHECKPOINTING:
        raise ConfigError(
            f"trainer.activation_checkpointing={value} is not one of none (= false), full (= true), selective"
        )
    policy = t.get("activation_checkpointing_policy", "ops")
    if policy not in CHECKPOINTING_POLICIES:
        raise ConfigError(
            f"trainer.activation_checkpointing_policy={policy} is not one of "
            f"{', '.join(CHECKPOINTING_POLICIES)}"
        )
    every = t.get("activation_checkpointing_every", 2)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"trainer.activation_checkpointing_every={every} must be an integer >= 1")
    if not isinstance(t.get("activation_offload", False), bool):
        raise ConfigError(f"trainer.activation_offload={t.get('activation_offload')} must be true or false")
    return {"none": None, "false": None, "true": "full"}.get(mode, mode)


def check_ema(decay: Any, strategy: str) -> None:
    """trainer.ema: null (off) or a decay in (0, 1); not with trainer=fsdp yet (training/ema.py)."""
    if decay is None:
        return
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
        raise ConfigError(
            f"trainer.ema={decay} must be a decay strictly between 0 and 1 (e.g. 0.999), or null for no EMA"
        )
    if strategy == "fsdp":
        raise ConfigError(
            "trainer.ema is not supported with trainer=fsdp yet (a sharded checkpoint does not carry the "
            "averages); use trainer=ddp or one device, or average step checkpoints with `gptkit merge`"
        )


def check_tensor_parallel(t: Any) -> int:
    """trainer.tensor_parallel=k (training/tensor_parallel.py) against the trainer group: an integer >= 1;
    k > 1 with trainer=fsdp, dividing the job's processes (when trainer.devices is a number; the mesh as a
    whole, expert parallelism included: check_mesh_shape), without in-training samples or task evaluations
    (they decode a whole model). Returns k."""
    k = t.get("tensor_parallel", 1)
    k = 1 if k is None else k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"trainer.tensor_parallel={k} must be an integer >= 1 (1: no tensor parallelism)")
    if k == 1:
        return k
    if str(t.get("strategy", "auto")) != "fsdp":
        raise ConfigError(
            f"trainer.tensor_parallel={k} runs under FSDP2's mesh: it needs trainer=fsdp (trainer.strategy="
            f"{t.get('strategy')})"
        )
    devices, nodes = t.get("devices"), t.get("num_nodes", 1)
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and isinstance(nodes, int):
        world = devices * nodes
        if world % k:
            larger = "is larger than" if k > world else "does not divide"
            raise ConfigError(
                f"trainer.tensor_parallel={k} {larger} the job's {world} process(es) (trainer.devices x "
                f"trainer.num_nodes); pass a divisor of {world}"
            )
    for key in ("sample_every", "eval_tasks"):
        if t.get(key):
            raise ConfigError(
                f"trainer.{key} with trainer.tensor_parallel={k} is not supported (they decode the whole "
                f"model); unset trainer.{key}, or sample the run's checkpoints afterwards"
            )
    return k


def check_tensor_parallel_model(cfg: Any, model: ModelConfig) -> None:
    """trainer.tensor_parallel=k against the model, the fine-tune and the objective (one-line errors): the
    multi-head attention of GPT-2 and Llama-style pre-norm blocks, heads (and d_ff) that split evenly."""
    k = check_tensor_parallel(cfg.trainer)
    if k == 1:
        return
    what = f"trainer.tensor_parallel={k}"
    if model.n_heads % k:
        raise ConfigError(f"{what} must divide model.n_heads={model.n_heads} (each rank whole heads)")
    if model.n_kv_heads % k and k % model.n_kv_heads:
        raise ConfigError(
            f"{what} and model.n_kv_heads={model.n_kv_heads}: one must divide the other (K/V heads split, "
            f"or replicated over the ranks of each group)"
        )
    if model.d_ff % k:
        raise ConfigError(f"{what} must divide model.d_ff={model.d_ff}")
    unsupported = [
        (
            any(model.attention_kind_of(i) != "mha" for i in range(model.n_layers)),
            "attention kinds other than mha (MLA, Gated DeltaNet)",
        ),
        (model.attn_sinks, "model.attn_sinks"),
        (model.attn_output_gate, "model.attn_output_gate"),
        (model.qk_norm == "full", "model.qk_norm=full (it normalizes every head together)"),
        (model.norm_placement != "pre", f"model.norm_placement={model.norm_placement}"),
        (bool(model.mtp_depth), "multi-token prediction (model.mtp)"),
        (model.score_head, "a score head (model.score_head)"),
        ("loss" in model.kernels, "the fused loss kernel (model.kernels: loss)"),
    ]
    for bad, name in unsupported:
        if bad:
            raise ConfigError(f"{what} covers GPT-2 and Llama-style blocks, not {name}")
    finetune, objective = str(cfg.get("finetune", "full")), str(cfg.get("objective", "lm"))
    if finetune != "full":
        raise ConfigError(f"{what} trains every weight: finetune={finetune} is not supported with it yet")
    if objective != "lm":
        raise ConfigError(f"{what} supports objective=lm only (not objective={objective}) yet")


def check_launcher(t: Any) -> None:
    """trainer.launcher: null, or ray with its trainer.ray settings (gptkit/training/ray_train.py); ray
    looked up (not imported: ~2 s)."""
    launcher = t.get("launcher")
    if launcher in (None, "null", "none"):
        return
    if launcher != "ray":
        raise ConfigError(f"trainer.launcher={launcher!r} is not one of null, ray")
    r = t.get("ray") or {}
    n = r.get("num_workers", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(
            f"trainer.ray.num_workers={n} must be an integer >= 1 (the processes Ray Train starts, one "
            "device each)"
        )
    failures = r.get("max_failures", 0)
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < -1:
        raise ConfigError(f"trainer.ray.max_failures={failures} must be an integer >= 0 (or -1: no limit)")
    cpus = r.get("cpus_per_worker", 1)
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not cpus > 0:
        raise ConfigError(f"trainer.ray.cpus_per_worker={cpus} must be a number > 0")
    devices = t.get("devices")
    if str(devices) not in ("1", "auto", str(n)):
        raise ConfigError(
            f"trainer.launcher=ray starts trainer.ray.num_workers={n} process(es) of one device each, "
            f"not trainer.devices={devices}; pass trainer.ray.num_workers={devices} (trainer.devices is "
            "set to it)"
        )
    if t.get("num_nodes") != 1:
        raise ConfigError(
            f"trainer.launcher=ray places its workers on the Ray cluster's nodes itself; "
            f"trainer.num_nodes={t.get('num_nodes')} is torchrun's and srun's: pass trainer.num_nodes=1 and "
            "trainer.ray.num_workers=<processes in all>"
        )
    if n > 1 and str(t.get("strategy", "auto")) == "auto":
        raise ConfigError(
            f"trainer.launcher=ray with trainer.ray.num_workers={n} needs a strategy of several "
            "processes: add trainer=ddp or trainer=fsdp"
        )
    require("ray", "trainer.launcher=ray needs", load=False)


def compile_mode(value: Any) -> str | None:
    """trainer.compile as None (none/false), "blocks" (true: each transformer block, regional) or "model" (the
    whole forward, loss included)."""
    if value in (False, None, "false", "none"):
        return None
    if value is True or value == "true":
        return "blocks"
    if value not in COMPILE_MODES:
        raise ConfigError(
            f"trainer.compile={value!r} is not one of none, {', '.join(COMPILE_MODES)} (or false/true)"
        )
    return value


def check_optim_values(cfg: Any) -> None:
    """One-line errors for the `optim` group's values (Muon's own settings, which need torch to check:
    optim.check_muon_config)."""
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={cfg.name!r} is not supported; use optim=adamw or optim=muon")
    if not float(cfg.lr) > 0:
        raise ConfigError(f"optim.lr={cfg.lr} must be > 0")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={cfg.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if cfg.get("min_lr") is not None:
        if isinstance(cfg.min_lr, bool) or not isinstance(cfg.min_lr, (int, float)):
            raise ConfigError(f"optim.min_lr={cfg.min_lr} is not a number (null: optim.lr / 10)")
        if not 0 <= float(cfg.min_lr) <= float(cfg.lr):
            raise ConfigError(
                f"optim.min_lr={cfg.min_lr} must be in [0, optim.lr={cfg.lr}] (or null: optim.lr / 10)"
            )
    if int(cfg.warmup_steps) < 0:
        raise ConfigError(f"optim.warmup_steps={cfg.warmup_steps} must be >= 0")
    adamw_implementation(cfg.fused, "cpu")


def adamw_implementation(fused: Any, device_type: str) -> str:
    """ "fused" (one kernel for every parameter update) or "foreach" (torch's default) for optim.fused
    (auto | true | false) on `device_type`. Clipping works with both: gptkit's mixed-precision plugin
    unscales before clipping (training/trainer.py)."""
    if fused == "auto":
        return "fused" if device_type in FUSED_DEVICES else "foreach"
    if fused is True:
        if device_type not in FUSED_DEVICES:
            raise ConfigError(
                f"optim.fused=true needs a CUDA GPU or the CPU, not {device_type}; use optim.fused=auto"
            )
        return "fused"
    if fused is False:
        return "foreach"
    raise ConfigError(f"optim.fused={fused!r} must be auto, true or false")


def check_loggers(logger_cfg: Any) -> None:
    """One line, before any data is prepared or any file written, for a logger whose package is missing."""
    for kind, opts in (logger_cfg or {}).items():
        if kind not in ("csv", *LOGGER_PACKAGES):
            raise ConfigError(f"unknown logger {kind!r}; use logger=[csv,tensorboard,wandb]")
        if kind in LOGGER_PACKAGES and (opts or {}).get("enabled", True):
            # an import, not a look-up: a broken install fails here too, not after the data is prepared
            require(kind)


# the attention backends whose blocks the ring merges by their log-sum-exp (training/context_parallel.py)
CP_BACKENDS = ("eager", "sdpa")


def check_context_parallel(t: Any, model: Optional[ModelConfig], compile: Optional[str] = None) -> int:
    """trainer.context_parallel=k (one-line errors): an integer >= 1; k > 1 with trainer=fsdp, k dividing the
    job's processes, the training window divisible by 2k (the zig-zag chunks), and (model known) a model the
    ring runs. Returns k."""
    k = t.get("context_parallel", 1)
    key = "trainer.context_parallel"
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"{key}={k} must be an integer >= 1 (1: each rank holds whole sequences)")
    if k == 1:
        return k
    if str(t.get("strategy", "auto")) != "fsdp":
        raise ConfigError(
            f"{key}={k} splits each sequence over ranks of the FSDP2 mesh: it needs trainer=fsdp"
        )
    devices = t.get("devices")
    if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        check_context_parallel_world(k, devices * int(t.num_nodes))
    seq = t.get("seq_len") or (model.max_seq_len if model is not None else None)
    if isinstance(seq, int) and seq % (2 * k):
        raise ConfigError(
            f"{key}={k}: the training window of {seq} tokens must be divisible by 2 x {k} = {2 * k} (each "
            f"rank holds two of {2 * k} equal chunks); set trainer.seq_len to a multiple of {2 * k}"
        )
    # compile: the trainer's compile mode, derived once (check_trainer_values)
    if compile is not None:
        raise ConfigError(f"{key}={k} runs its ring eagerly: pass trainer.compile=null")
    if model is not None:
        check_context_parallel_model(model, k)
    return k


def check_context_parallel_model(model: ModelConfig, k: int) -> None:
    """What the ring attention runs: multi-head attention layers, a backend that returns its log-sum-exp to
    the ring, no soft-capping or sinks (one-line errors)."""
    key = f"trainer.context_parallel={k}"
    if model.attention not in CP_BACKENDS:
        raise ConfigError(
            f"{key} merges attention blocks by their log-sum-exp, which model.attention={model.attention} "
            f"does not return to the ring (the Triton kernel's masks are local to one sequence); pass "
            f"model.attention=sdpa or eager"
        )
    kinds = sorted({model.attention_kind_of(i) for i in range(model.n_layers)})
    if kinds != ["mha"]:
        raise ConfigError(f"{key} runs multi-head attention layers only, not {', '.join(kinds)}")
    for name in ("attn_softcap", "attn_sinks", "dropout", "mtp"):
        if getattr(model, name):
            raise ConfigError(f"{key} does not support model.{name} yet")
    if model.moe is not None:
        # a sequence's router figures (the balance loss) would be each rank's half of it: unchecked
        raise ConfigError(
            f"{key} does not support model.moe yet (the router's balance loss is not reduced over the "
            "context ranks); use trainer.expert_parallel or trainer.tensor_parallel for a mixture of experts"
        )


def check_context_parallel_world(k: int, world: int) -> None:
    """trainer.context_parallel=k against the job's `world` processes (one-line errors)."""
    key = "trainer.context_parallel"
    if k > world:
        raise ConfigError(
            f"{key}={k} asks for a mesh of {k} ranks per sequence, larger than the job's {world} "
            f"process(es) (trainer.devices x trainer.num_nodes)"
        )
    if world % k:
        raise ConfigError(
            f"{key}={k} must divide the job's {world} process(es) (trainer.devices x trainer.num_nodes): "
            f"a mesh of {k} ranks per sequence does not fit"
        )


def _degree(t: Any, key: str) -> int:
    k = t.get(key, 1)
    k = 1 if k is None else k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"trainer.{key}={k} must be an integer >= 1")
    return k


def check_mesh_shape(t: Any, world: Optional[int] = None) -> tuple[int, int, int, int]:
    """The device mesh's degrees (training/mesh.py) against the job's `world` processes (None: trainer.devices
    x trainer.num_nodes when they are numbers; else the degrees alone): dp_replicate x dp_shard x cp x tp =
    world, expert_parallel dividing dp_shard x cp. One line naming the first dimension, inner to outer, that
    is larger than what is left of the world or does not divide it. Returns (replicate, cp, tp, ep)."""
    r = _degree(t, "data_parallel_replicate")
    cp, tp, ep = (_degree(t, k) for k in ("context_parallel", "tensor_parallel", "expert_parallel"))
    if r > 1 and str(t.get("strategy", "auto")) != "fsdp":
        raise ConfigError(
            f"trainer.data_parallel_replicate={r} replicates FSDP2's shards (HSDP): it needs trainer=fsdp "
            f"(trainer.strategy={t.get('strategy')})"
        )
    # the degrees' own checks refuse them without trainer=fsdp, and each against the whole world
    if str(t.get("strategy", "auto")) != "fsdp":
        return r, cp, tp, ep
    if world is None:
        devices, nodes = t.get("devices"), t.get("num_nodes", 1)
        if isinstance(devices, str) and devices.isdigit():
            devices = int(devices)
        if not (isinstance(devices, int) and not isinstance(devices, bool) and isinstance(nodes, int)):
            return r, cp, tp, ep
        world = devices * nodes
    left, of, taken = world, f"the job's {world} process(es) (trainer.devices x trainer.num_nodes)", []
    for key, k in (("tensor_parallel", tp), ("context_parallel", cp), ("data_parallel_replicate", r)):
        if left % k:
            verb = "is larger than" if k > left else "does not divide"
            raise ConfigError(
                f"trainer.{key}={k} {verb} {of}; the mesh does not factor: pass a divisor of {left}"
            )
        if k > 1:
            left //= k
            taken.append(f"trainer.{key}={k}")
            of = f"the {left} rank(s) left of the job's {world} by {' x '.join(taken)}"
    # left: dp_shard; the experts are split over ranks of dp_shard x cp
    if (left * cp) % ep and world % ep == 0:
        verb = "is larger than" if ep > left * cp else "does not divide"
        raise ConfigError(
            f"trainer.expert_parallel={ep} {verb} the dp_shard x cp = {left} x {cp} = {left * cp} rank(s) a "
            f"replica shards over; pass a divisor of {left * cp}"
        )
    return r, cp, tp, ep
