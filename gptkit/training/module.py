"""The LightningModule: a thin wrapper that trains the pure GPT. Start reading the training here.

One optimizer step, top to bottom (Lightning runs the loop; this is the order it runs our parts in, and
the class that owns each). Every setting comes from the run plan (training/plan.py).

     1. batch          the data's sampler (TokenDataModule, any kind): micro-batch N of a rank is a
                       pure function of (seed, N, rank, world size), so a resume draws the same batches
                                                                  data/datamodule.py, data/face.py
     2. forward, loss  LitGPT.training_step -> the objective's loss(model, batch) and its weight; lm:
                       GPT.forward(x, targets).loss (fp32 mean cross-entropy) weighted by its loss tokens
                       (TokenMean.micro_batch) when a step has several micro-batches or ranks; dpo: the
                       DPO loss of the batch's pairs against the frozen reference (every micro-batch holds
                       as many pairs: no token weight); model.moe: plus the feed-forwards' balance and
                       z-losses of its forwards (RouterWatch)
                                        here, training/objectives/, training/token_mean.py, training/moe.py
     3. NaN window     LossWindow.add: the loss summed on the device (weighted by its loss tokens), the
                       first non-finite step noted; no host sync            training/metrics.py
     4. backward       Lightning: (loss / accumulation).backward(); 16-mixed scales the loss first
     5. accumulation   steps 1-4 run plan.accumulation times (trainer.accumulate_grad_batches); DDP
                       all-reduces the gradients on the last micro-batch only; FSDP2 reduce-scatters them
     6. unscale        ClippingMixedPrecision.optimizer_step: GradScaler.unscale_ (16-mixed only)
                                                                            training/trainer.py
     6b. token mean    LitGPT.on_before_optimizer_step -> TokenMean.finish: the gradient becomes the mean
                       over every loss token of the step, all micro-batches and ranks (one scalar
                       all-reduce, on the device)                           here, training/token_mean.py
     7. clip           LitGPT.configure_gradient_clipping: the total gradient norm (kept on the device for
                       train/grad_norm: LossWindow.add_grad_norm), then norm clipping at
                       trainer.gradient_clip_val, on unscaled gradients, so it works with fused AdamW
                                                                            here, training/metrics.py
     8. optimizer      AdamW.step (fused or foreach; scaler.step + update for 16-mixed), zero_grad;
                       model.moe with moe.bias_update_rate > 0: each layer's expert bias moved by the step's
                       loads over every micro-batch and rank (LitGPT.optimizer_step)
                                                                            training/optim.py, training/moe.py
     9. scheduler      the LambdaLR of configure_optimizers, stepped every optimizer step (warmup, then
                       cosine / linear / WSD down to optim.min_lr)          training/optim.py
    10. log            every trainer.log_every steps, StepMetrics.on_train_batch_end: LossWindow.read
                       (the one host sync; a non-finite loss stops the run here), tokens/s, FLOP/s, MFU,
                       one row to every logger, the progress line           training/metrics.py,
                                                                            metrics_csv.py, progress.py
    11. checkpoint     every trainer.checkpoint_every steps, and at the step that ends the invocation
                       (max_steps, stop_at_step, SIGINT/SIGTERM), RunCheckpoints.on_train_batch_end:
                       LossWindow.check_finite first, then saved under a hidden name; published at the
                       start of the next step, once the metrics rows it covers are on disk
                                                                            training/run_checkpoints.py
    12. validate       every trainer.val_every steps, after the step's callbacks: validation_step and
                       on_validation_epoch_end (the objective's figures: val/loss, val/ppl, ...)
                                                                            here, training/objectives/
    13. watch          after each validation: best.ckpt when val/loss is the lowest (trainer.keep_best,
                       RunCheckpoints), then loss.png redrawn and, every trainer.sample_every steps, a
                       greedy sample (ValidationWatch, rank 0 reports)      training/run_checkpoints.py,
                                                                            training/watch.py

StepMetrics runs before RunCheckpoints (build_trainer's callback order), so a step's row is written
before its checkpoint. nanoGPT's train.py and litgpt's pretrain.py:fit write the same loop by hand;
`gptkit bench train` times this one against such a hand-written loop over the same model and batches.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
import torch

from gptkit.data.datamodule import data_ranks
from gptkit.errors import GptkitError
from gptkit.model import GPT
from gptkit.runs import is_rank_zero
from gptkit.training import activations
from gptkit.training.distributed import broadcast_weights, clip_gradients, parallelize
from gptkit.training.finetune import written_by
from gptkit.training.metrics import LossWindow
from gptkit.training.moe import RouterWatch, progress_parts
from gptkit.training.objectives import FrozenModel, objective_class
from gptkit.training.optim import build_optimizer, build_scheduler, check_muon_split
from gptkit.training.plan import RunPlan
from gptkit.training.start import FROM_START, frozen_source
from gptkit.training.tensor_parallel import loss_context, objective_model
from gptkit.training.token_mean import TokenMean

# the checkpoint entry of the objective's own state (Objective.state)
OBJECTIVE_STATE = "gptkit_objective"


def apply_compile(model: GPT, mode: str, backend: str = "inductor") -> None:
    """torch.compile in place (parameter names and checkpoints unchanged). "blocks" compiles each block:
    the blocks share one compiled graph (torch inlines nn modules, so their weights are inputs), which
    keeps compile time near that of one block; "model" compiles the whole forward and its loss."""
    if mode == "model":
        model.compile(backend=backend)
    else:
        for block in model.blocks:
            block.compile(backend=backend)


def apply_activation_checkpointing(model: GPT) -> None:
    """Recompute each transformer block in the backward pass instead of keeping its activations
    (trainer.activation_checkpointing=true; selective policies, offloading: training/activations.py)."""
    activations.apply(model, "full")


class LitGPT(L.LightningModule):
    """The model, its loss, its optimizer and schedule, for Lightning; every setting from the run plan.
    The fine-tune (training/finetune/: full, lora, qlora) is applied to the built model from outside it and
    says what a checkpoint holds."""

    def __init__(self, plan: RunPlan) -> None:
        """plan.weights_from_rank0 (FSDP over several processes): only global rank 0 builds and initializes
        the full model on the host; the other ranks build it on the meta device (no memory) and receive
        their shards of rank 0's weights once it is sharded (configure_model). A 7B model then takes ~28 GB
        of host memory in one process of the job instead of in every one. A fine-tune that materializes its
        weights (qlora) builds on the meta device on every rank and fills them in configure_model."""
        super().__init__()
        self.finetune = plan.finetune_class(plan)
        self.weights_from_rank0 = plan.weights_from_rank0
        self.built_on_meta = (self.weights_from_rank0 and not is_rank_zero()) or self.finetune.materializes
        with torch.device("meta") if self.built_on_meta else contextlib.nullcontext():
            self.model = GPT(plan.model)
        # the trainable parameters (None: every one)
        self.trainable = self.finetune.apply(self.model)
        # a checkpoint may hold only what trains (the adapters); on_load_checkpoint checks it
        self.strict_loading = self.finetune.saves_every_weight
        # what the run trains for (training/objectives/), and the frozen models it reads (its reference, a
        # teacher), by name: a plain dict, so none is a submodule (in no checkpoint, no optimizer)
        objective = objective_class(plan.cfg)
        # FSDP over several processes: a frozen model with weights of its own is built on rank 0 only too
        self.frozen_on_meta = self.weights_from_rank0 and not is_rank_zero()
        names = objective.frozen_models(objective.settings_of(plan.cfg))
        self.frozen = {name: self._frozen(plan, name) for name in names}
        self.objective = objective(plan, self.frozen)
        # trainer.activation_checkpointing (full, selective) and trainer.activation_offload
        activations.apply_from_config(self.model, plan.trainer)
        # before the run folder gets its files
        if plan.optim.name == "muon":
            check_muon_split(self.model)
        self.optim_cfg = plan.optim
        self.max_steps = plan.max_steps
        self.compile_mode = plan.compile
        self.compile_backend = plan.compile_backend
        # read at log steps only (training/metrics.py)
        self.loss_window = LossWindow()
        # every loss token of an optimizer step weighs the same, across micro-batches and ranks
        self.token_mean = TokenMean(plan.accumulation, plan.world_size, plan.rows * plan.seq_len)
        # model.moe: the feed-forwards' auxiliary loss, the router figures, the expert bias (training/moe.py)
        self.router_watch = RouterWatch(self.model, plan.world_size, move_bias=self.finetune.trains_base)

    def _frozen(self, plan: RunPlan, name: str) -> FrozenModel:
        """The frozen model `name` the objective reads: from its own source (plan.frozen: a run, an import,
        hf:; a GPT of that source's config, any size), else the starting weights: the fine-tune's own (lora,
        qlora: the policy itself with its adapters off, no second copy), else a frozen GPT of the policy's
        shape. fit loads the weights (training/start.py load_frozen); built on the meta device where the
        policy's weights come from rank 0."""
        source = (plan.frozen or {}).get(name)
        if source is None and frozen_source(plan.cfg, name) != FROM_START:
            raise GptkitError(f"frozen.{name} is not resolved; build the plan with gptkit.plan or plan_run")
        if source is None and self.finetune.own_reference:
            frozen = self.finetune.reference()
            frozen.name = name
            return frozen
        with torch.device("meta") if self.frozen_on_meta else contextlib.nullcontext():
            return FrozenModel(GPT(source.model if source is not None else plan.model), name=name)

    @property
    def reference(self) -> FrozenModel | None:
        """The objective's "reference" frozen model (None: it reads none)."""
        return self.frozen.get("reference")

    def frozen_modules(self) -> list[torch.nn.Module]:
        """The frozen models' own weights (not the policy with its adapters off)."""
        return [f.module for f in self.frozen.values() if f.module is not None]

    def configure_model(self) -> None:
        """FSDP2: shard each block (and send rank 0's weights); a fine-tune that materializes its weights
        (qlora) puts them in place, sharded or whole; then compile, once (plan.compile)."""
        strategy = self.trainer.strategy
        models = [self.model, *self.frozen_modules()]
        on_rank0 = self.weights_from_rank0 and not self.built_on_meta
        # references to rank 0's tensors
        full = [m.state_dict() if on_rank0 else None for m in models]
        for m, state in zip(models, full):
            # FSDP2: shards per block; else no-op
            if parallelize(m, strategy) and self.weights_from_rank0:
                broadcast_weights(m, state, strategy.root_device)
        if self.weights_from_rank0 and getattr(self.model, "_gptkit_sharded", False):
            self.built_on_meta = False
        del full
        if self.finetune.materializes and self.built_on_meta:
            self.finetune.materialize(self, strategy.root_device)
            self.built_on_meta = False
        # trainer.context_parallel=k: sequences over k ranks, attention a ring (training/context_parallel.py)
        k = int(getattr(strategy, "context_parallel", 1) or 1)
        if k > 1 and getattr(self, "context_parallel", None) is None:
            from gptkit.training.context_parallel import ContextParallel

            # the run's mesh (training/mesh.py): this rank's cp ranks
            self.context_parallel = ContextParallel(self.model, strategy.mesh["cp"].get_group())
        if self.compile_mode and not getattr(self, "_compiled", False):
            apply_compile(self.model, self.compile_mode, self.compile_backend)
            self._compiled = True

    def on_fit_start(self) -> None:
        """The frozen models not sharded: on the policy's device and in its dtype (Lightning moves and
        converts the LightningModule's own modules only; with trainer.precision=bf16-true a float32 reference
        would give DPO rewards that are not 0 at the start)."""
        weight = self.model.tok_emb.weight
        for frozen in self.frozen_modules():
            if not getattr(frozen, "_gptkit_sharded", False):
                frozen.to(device=weight.device, dtype=weight.dtype)

    def training_step(self, batch, batch_idx):
        """Step 2 and 3 of the header: the objective's loss of one micro-batch, added to the NaN window."""
        cp = getattr(self, "context_parallel", None)
        # trainer.tensor_parallel: the cross-entropy over the vocabulary-sharded logits (loss_parallel)
        with loss_context(self.model):
            if cp is None:
                loss, n = self.objective.loss(objective_model(self.model), batch)
            else:
                # this rank's share of every sequence: its loss tokens weigh as theirs (token_mean)
                try:
                    loss, n = self.objective.loss(self.model, cp.enter(batch))
                finally:
                    cp.exit()
        # on the device: no host sync (StepMetrics reads it); the objective's loss alone
        self.loss_window.add(loss, self.global_step, n)
        # model.moe: the balance and z-losses of the forwards it ran, weighted as the loss (training/moe.py)
        aux = self.router_watch.take()
        if aux is not None:
            loss = loss + aux
        # n None: every micro-batch weighs the same
        return loss if n is None else self.token_mean.micro_batch(loss, n)

    def backward(self, loss, *args, **kwargs) -> None:
        """Step 4 of the header: Lightning's backward, under loss_parallel for a tensor-parallel model."""
        with loss_context(self.model):
            super().backward(loss, *args, **kwargs)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """Step 8 of the header, then (model.moe with an expert bias) the bias update from the step's loads:
        before any callback of the step, so its checkpoint holds the moved bias."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self.router_watch.after_optimizer_step()

    def on_before_optimizer_step(self, optimizer) -> None:
        """Step 6b of the header: the accumulated gradients become the mean over the step's loss tokens."""
        self.token_mean.finish(p for group in optimizer.param_groups for p in group["params"])

    def _val_sources(self):
        """(source names, source index of each val window) from the datamodule (names: [] for one corpus);
        None for data=chat (and without a datamodule)."""
        trainer = getattr(self, "_trainer", None)
        return getattr(getattr(trainer, "datamodule", None), "val_sources", None) if trainer else None

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Step 7 of the header: the total gradient norm before clipping, kept on the device for
        train/grad_norm, and the clipping itself (norm at gradient_clip_val; none when it is null)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return
        # the gradients are unscaled already (ClippingMixedPrecision), so this works with fused AdamW;
        # FSDP2: the norm of the whole model (a collective, no host sync)
        clip = None if gradient_clip_val is None else float(gradient_clip_val)
        self.loss_window.add_grad_norm(clip_gradients(params, clip))

    def validation_step(self, batch, batch_idx):
        """One validation batch, added to the objective's sums on the device."""
        # the ranks that read distinct items (trainer.context_parallel: one per group; tensor_parallel: the
        # data-parallel rank)
        rank, world = data_ranks(self.trainer)
        with loss_context(self.model):
            self.objective.validate(objective_model(self.model), batch, rank, world, self._val_sources())

    def on_validation_epoch_end(self) -> None:
        """Log the objective's validation figures (reduced over the ranks by the objective: the same on every
        rank, each val item counted once), at the step of the validation."""
        metrics = self.objective.val_metrics(self.trainer.strategy, self._val_sources())
        for key, value in metrics.items():
            self.log(key, value, prog_bar=key == "val/loss", sync_dist=False)
        # validation after N optimizer steps is logged at step N
        if metrics:
            self.log("step", float(self.global_step))

    def train_metrics(self, strategy) -> dict[str, float]:
        """Read at log steps (StepMetrics): the objective's own figures (DPO: train/rewards/*) and a
        mixture's router figures (training/moe.py)."""
        return {**self.objective.train_metrics(strategy), **self.router_watch.read(strategy)}

    def progress_parts(self, metrics: dict[str, float]) -> list[str]:
        """What a log step's progress line shows after the loss: the objective's parts, then a mixture's."""
        return self.objective.progress(metrics) + progress_parts(metrics)

    def configure_optimizers(self):
        """AdamW and the per-step schedule of the `optim` group."""
        opt = build_optimizer(self.model, self.optim_cfg)
        sched = build_scheduler(opt, self.optim_cfg, self.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    # RNG state travels with the checkpoint so that dropout continues exactly after a resume
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the RNG states with the checkpoint (dropout continues exactly on resume)."""
        checkpoint["gptkit_rng"] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            checkpoint["gptkit_rng"]["cuda"] = torch.cuda.get_rng_state_all()
        # the checkpoints the frozen models came from (not their weights)
        for frozen in self.frozen.values():
            frozen.save(checkpoint)
        # what the objective keeps across steps (GRPO: the rollouts of a batch it passes over again)
        state = self.objective.state()
        if state is not None:
            checkpoint[OBJECTIVE_STATE] = state
        # lora, qlora: the adapters (their optimizer state is all there is) and the record of the base
        self.finetune.on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the checkpoint's RNG states to restore when training starts."""
        rng = checkpoint.get("gptkit_rng")
        if rng:
            self._rng_to_restore = rng
        for frozen in self.frozen.values():
            frozen.check(checkpoint)
        self.objective.load_state(checkpoint.get(OBJECTIVE_STATE))
        if written_by(checkpoint) != self.finetune.name:
            raise GptkitError(
                f"the checkpoint was written by a finetune={written_by(checkpoint)} run, this one is "
                f"finetune={self.finetune.name} (a LoRA or QLoRA checkpoint holds adapters only, a full one "
                "every weight): resume with the run's own finetune="
            )
        self.finetune.on_load_checkpoint(checkpoint, self.model.cfg)

    def on_train_start(self) -> None:
        """Restore the RNG states of the checkpoint a resume continues."""
        rng = getattr(self, "_rng_to_restore", None)
        if rng:
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
