"""The run plan: every fact of a training run that follows from its config, derived once.

`gptkit train` composes the config (Hydra), checks it (fit.check_config, which returns what it derived
as a Checked: precision, accelerator, devices, nodes, compile mode, a new run's model and window),
applies resume= / init_from= (fit.resolve_resume, fit.resolve_init_from), prepares the data (the
tokenizer fixes the vocabulary) and then calls make_plan, which reads the Checked instead of deriving it
again. From there on every part reads the plan and re-derives nothing (.ci/rederivations counts it):

    plan.model            the ModelConfig (vocab_size from the tokenizer, or the source run's model)
    plan.seq_len          the training window (trainer.seq_len, or model.max_seq_len)
    plan.world_size       processes in the job (devices per node x nodes)
    plan.tokens_per_step  rows x seq_len x accumulation x world_size (plan.rows: batch_size items x the
                          objective's rows per item; a DPO pair is two rows)
    plan.max_steps        trainer.max_steps, or trainer.max_tokens / tokens_per_step
    plan.precision        the Precision (gptkit.precision), plan.accelerator "cpu" | "cuda"
    plan.compile          None | "blocks" | "model" (trainer.compile)
    plan.flops_per_token  training FLOPs per token (6N + 12·L·T·d_attn, as count-params; an objective
                          with a reference: + its forward, 2N + 4·L·T·d_attn), plan.peak_flops
    plan.objective        "lm" | "dpo" | "grpo" (plan.objective_class: its class, training/objectives/)
    plan.data             the prepared corpus (None for a plan made without data: gptkit.train prepares it)

Readers: trainer.build_trainer (Lightning Trainer, callbacks), module.LitGPT (model, compile, optimizer
and schedule), fit (start-up lines, disk check, summary, out-of-memory message), commands/preflight and
bench/train (the same plan without data).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from gptkit import accounting as acc
from gptkit.conf_tree import count
from gptkit.errors import ConfigError
from gptkit.model.config import ModelConfig
from gptkit.parallel_plan import MESH_KEYS, check_mesh
from gptkit.precision import Precision
from gptkit.training.config_checks import Values, check_tensor_parallel_model, check_trainer_values
from gptkit.training.distributed import accelerator_type, devices_per_node
from gptkit.training.expert_parallel import check_expert_model
from gptkit.training.finetune import Finetune, finetune_class
from gptkit.training.metrics import detect_peak_flops
from gptkit.training.objectives import Objective, objective_class
from gptkit.training.optim import lr_factor, min_lr
from gptkit.training.profile import check_profile


def train_seq_len(t: Any, model_cfg: ModelConfig) -> int:
    """The training window: trainer.seq_len (at most the model's context), or model.max_seq_len when null."""
    seq_len = t.get("seq_len")
    if seq_len is None:
        return model_cfg.max_seq_len
    if not 1 <= int(seq_len) <= model_cfg.max_seq_len:
        raise ConfigError(
            f"trainer.seq_len={seq_len} must be in [1, model.max_seq_len={model_cfg.max_seq_len}]"
        )
    return int(seq_len)


def planned_steps(t: Any, tokens_per_step: int) -> int:
    """trainer.max_steps, or trainer.max_tokens (a count: 300M, 2T) in steps of tokens_per_step (rounded
    up)."""
    if t.get("max_tokens") is not None:
        steps = math.ceil(count(t.max_tokens, "trainer.max_tokens") / tokens_per_step)
    else:
        steps = int(t.max_steps)
    if steps < 1:
        raise ConfigError(f"trainer.max_steps={steps} must be >= 1")
    return steps


@dataclass(frozen=True)
class Checked:
    """What checking a config derives before any data (trainer.check_trainer_config, fit.check_config):
    make_plan completes it, so none of it is derived a second time."""

    precision: Precision
    # "cpu" | "cuda"
    accelerator: str
    # processes per node
    devices: int
    nodes: int
    # None | "blocks" | "model"
    compile: Optional[str]
    # a new run's model (vocab_size: the config's); resume/init_from: None
    model: Optional[ModelConfig] = None
    # the training window of `model`
    seq_len: Optional[int] = None

    @property
    def world_size(self) -> int:
        """Processes in the job: devices per node x nodes."""
        return self.devices * self.nodes


def check_trainer(t: Any, values: Values | None = None) -> Checked:
    """The `trainer` group's facts, each derived once: precision, accelerator, devices, nodes, compile mode
    (one-line ConfigErrors for a value none of them takes). values: config_checks.check_trainer_values(t),
    when already derived."""
    values = values or check_trainer_values(t)
    accelerator = accelerator_type(t)
    return Checked(
        precision=values.precision,
        accelerator=accelerator,
        devices=devices_per_node(t, accelerator),
        nodes=int(t.num_nodes),
        compile=values.compile,
    )


def with_model(checked: Checked, t: Any, model: ModelConfig) -> Checked:
    """`checked` with a new run's model and its training window (trainer.seq_len checked against it)."""
    return dataclasses.replace(checked, model=model, seq_len=train_seq_len(t, model))


@dataclass(frozen=True)
class RunPlan:
    """One training run, resolved: what every part of `train` reads (see the module docstring)."""

    # the run's config as saved to config.yaml (its model: plan.model)
    cfg: DictConfig
    # None for a plan without a run (preflight)
    run_dir: Optional[Path]
    model: ModelConfig
    seq_len: int
    # sequences per device in one micro-batch
    batch_size: int
    # micro-batches per optimizer step
    accumulation: int
    # processes per node
    devices: int
    nodes: int
    world_size: int
    # one optimizer step, all ranks together
    tokens_per_step: int
    max_steps: int
    precision: Precision
    # "cpu" | "cuda"
    accelerator: str
    # None | "blocks" | "model"
    compile: Optional[str]
    compile_backend: str
    # training FLOPs per token, the MFU convention (6N + 12·L·T·d_attn, full attention; finetune=lora,
    # qlora: 4N + 6 per adapter parameter + 12·L·T·d_attn, the frozen weights getting no weight gradient)
    flops_per_token: float
    # the attention term halved (perf/mfu_causal)
    causal_flops_per_token: float
    # one device's peak for plan.precision; None where unknown
    peak_flops: Optional[float]
    # the checkpoint resume= continues
    resume: Optional[Path] = None
    resume_step: Optional[int] = None
    # the checkpoint init_from= takes the weights of
    init_from: Optional[Path] = None
    # on resume with another max_steps: how the schedule moves
    replan: Optional[str] = None
    # finetune=lora, qlora: the adapters' rank, alpha, dropout, targets (None: every weight trains)
    lora: Optional[dict] = None
    # finetune=lora, qlora: the checkpoint of the frozen weights the adapters adapt
    lora_base: Optional[Path] = None
    # "job 1: optim.lr=3e-3" for one job of a multirun
    job: Optional[str] = None
    # the prepared corpus (gptkit.data: PreparedData, MixedData or ChatData) the run trains on; None for a
    # plan made without data (preflight, bench, or a Python caller's make_plan: gptkit.train prepares it)
    data: Any = None
    # init_from= with tokens a chat template added: the source's vocab_size
    init_vocab: Optional[int] = None
    # trainer.profile: the optimizer steps (first, last) recorded with torch.profiler (training/profile.py)
    profile: Optional[tuple[int, int]] = None
    # the objective's frozen models with a source of their own (frozen.<name> other than start: a run, an
    # import, hf:), by name (training/start.py FrozenSource); None until resolved (they need the tokenizer)
    frozen: Optional[dict[str, Any]] = None

    @property
    def trainer(self) -> DictConfig:
        """The `trainer` group (the knobs the plan does not resolve: log_every, val_every, ...)."""
        return self.cfg.trainer

    @property
    def optim(self) -> DictConfig:
        """The `optim` group: optimizer and schedule."""
        return self.cfg.optim

    @property
    def objective(self) -> str:
        """objective: lm (next-token loss) | dpo (preference pairs against a frozen reference) | grpo (RL
        from rewards on sampled completions)."""
        return self.objective_class.name

    @property
    def finetune(self) -> str:
        """finetune: full | lora | qlora (training/finetune/)."""
        return self.finetune_class.name

    @property
    def finetune_class(self) -> type[Finetune]:
        """The fine-tune's class (training/finetune/): which weights train, what a checkpoint holds."""
        return finetune_class(self.cfg)

    @property
    def objective_class(self) -> type[Objective]:
        """The objective's class (training/objectives/): its loss, what it logs and needs."""
        return objective_class(self.cfg)

    @property
    def objective_settings(self) -> Any:
        """The objective's config group (cfg.<group>; None when it has none)."""
        return self.objective_class.settings_of(self.cfg)

    @property
    def rows(self) -> int:
        """Sequences through the model per device and micro-batch: batch_size items x the objective's rows
        per item."""
        return self.batch_size * self.objective_class.rows(self.objective_settings)

    @property
    def strategy(self) -> str:
        """trainer.strategy: auto | ddp | fsdp."""
        return str(self.cfg.trainer.strategy)

    @property
    def weights_from_rank0(self) -> bool:
        """FSDP over several processes: only global rank 0 builds the full model (module.LitGPT), unless the
        fine-tune materializes its weights on every rank itself (qlora)."""
        return self.strategy == "fsdp" and self.world_size > 1 and not self.finetune_class.materializes

    @property
    def shards(self) -> int:
        """How many ways the weights and optimizer state are split (FSDP: world_size; HSDP,
        trainer.data_parallel_replicate=r: the world_size / r ranks of a replica; else 1)."""
        if self.strategy != "fsdp":
            return 1
        return self.world_size // int(self.cfg.trainer.get("data_parallel_replicate") or 1)

    @property
    def expert_shards(self) -> int | None:
        """trainer.expert_parallel > 1: how many ways a mixture's experts are split (else None)."""
        k = int(self.cfg.trainer.get("expert_parallel") or 1)
        return k if k > 1 else None

    @property
    def total_tokens(self) -> int:
        """Tokens the whole plan trains on: tokens_per_step x max_steps."""
        return self.tokens_per_step * self.max_steps


def make_plan(
    cfg: DictConfig,
    run_dir: Optional[Path],
    model: ModelConfig,
    *,
    checked: Optional[Checked] = None,
    resume: Optional[Path] = None,
    resume_step: Optional[int] = None,
    init_from: Optional[Path] = None,
    saved_trainer: Optional[DictConfig] = None,
    job: Optional[str] = None,
    data: Any = None,
    init_vocab: Optional[int] = None,
    lora_base: Optional[Path] = None,
) -> RunPlan:
    """The plan of a run whose config was checked (fit.check_config) and whose model is known.
    checked: what that check derived (the trainer's facts; the training window of a new run's model), read
    here instead of derived again; None derives it (check_trainer). saved_trainer: on resume, the `trainer`
    group the run was planned with (for the re-planning note). data: the prepared corpus, when known."""
    t = cfg.trainer
    if checked is None:
        checked = check_trainer(t)
    same_window = checked.model is not None and checked.model.max_seq_len == model.max_seq_len
    seq_len = checked.seq_len if same_window and checked.seq_len is not None else train_seq_len(t, model)
    # trainer.devices=auto: every visible GPU
    per_node = checked.devices
    world = checked.world_size
    objective = objective_class(cfg)
    # batch_size items of the objective's rows each (a DPO pair: chosen and rejected)
    group = objective.settings_of(cfg)
    rows = int(t.batch_size) * objective.rows(group)
    # trainer.context_parallel=k: the k ranks of a group share their sequences; trainer.tensor_parallel=k:
    # each group of k ranks reads one batch
    data_world = world // int(t.get("context_parallel") or 1) // int(t.get("tensor_parallel") or 1)
    tokens_per_step = rows * seq_len * int(t.accumulate_grad_batches) * data_world
    max_steps = planned_steps(t, tokens_per_step)
    # a range outside the steps this invocation trains is a one-line error
    profile = check_profile(t.get("profile"), max_steps, resume_step)
    replan = None
    if saved_trainer is not None:
        saved_steps = planned_steps(saved_trainer, tokens_per_step)
        replan = schedule_note(saved_steps, max_steps, int(resume_step or 0), cfg.optim)
    p = checked.precision
    finetune = finetune_class(cfg)
    lora = finetune.adapters(cfg)
    check_expert_model(int(t.get("expert_parallel") or 1), model, finetune.name)
    # resume= and init_from= bring their model: checked here (a new one: config_checks.check_values)
    check_tensor_parallel_model(cfg, model)
    # trainer.tensor_parallel x trainer.context_parallel: a mesh that divides the world and the model
    check_mesh(
        model,
        world,
        t.get("tensor_parallel") or 1,
        t.get("context_parallel") or 1,
        seq_len=seq_len,
        keys=MESH_KEYS,
    )
    flops = acc.flops_per_token(model, seq_len)
    # what the fine-tune trains (lora, qlora: no weight gradient for the frozen weights)
    dense, causal = finetune.flops(model, lora, flops, flops.train_dense, flops.train_causal)
    # the objective's own work (a reference's forward, no grad)
    dense, causal = objective.flops(flops, dense, causal, group)
    return RunPlan(
        cfg=cfg,
        run_dir=run_dir,
        model=model,
        seq_len=seq_len,
        batch_size=int(t.batch_size),
        accumulation=int(t.accumulate_grad_batches),
        devices=per_node,
        nodes=checked.nodes,
        world_size=world,
        tokens_per_step=tokens_per_step,
        max_steps=max_steps,
        precision=p,
        accelerator=checked.accelerator,
        compile=checked.compile,
        compile_backend=str(t.get("compile_backend") or "inductor"),
        flops_per_token=dense,
        causal_flops_per_token=causal,
        peak_flops=detect_peak_flops(p, t.get("peak_tflops")),
        resume=resume,
        resume_step=resume_step,
        init_from=init_from,
        replan=replan,
        job=job,
        data=data,
        init_vocab=init_vocab,
        lora=lora,
        lora_base=lora_base,
        profile=profile,
    )


def schedule_note(saved_max_steps: int | None, max_steps: int, step: int, optim: Any) -> str | None:
    """On resume: one line when the schedule is re-planned (another max_steps), with the lr before and
    after."""
    if saved_max_steps is None or saved_max_steps == max_steps:
        return None
    kw = dict(
        schedule=optim.schedule,
        warmup_steps=int(optim.warmup_steps),
        lr=float(optim.lr),
        min_lr=min_lr(optim),
        decay_fraction=float(optim.decay_fraction),
    )
    before = float(optim.lr) * lr_factor(step, max_steps=saved_max_steps, **kw)
    after = float(optim.lr) * lr_factor(step, max_steps=max_steps, **kw)
    return (
        f"the {optim.schedule} schedule is re-planned for {max_steps} steps instead of "
        f"{saved_max_steps}: lr at step {step} {before:.3g} -> {after:.3g}"
    )
