"""The interface every training objective implements, and the frozen reference some of them measure against.

LitGPT (gptkit/training/module.py) runs any objective the same way and never asks which it has:

    plan time (classmethods, from the config alone; gptkit/training/plan.py, fit.py, memory.py; `group` is
    its config group, cfg.<group>, or None)
        check_config(group)          its own config group, one-line ConfigErrors
        check_run(cfg)               what else of the run's config concerns it (GRPO: trainer.compile;
                                     loading the user's reward functions, said at start-up)
        data_kinds, needs_start      what it trains on, and whether it starts from weights (init_from=)
        loss_spikes                  whether trainer.spike_factor's spike notes judge its loss
        chunked_logps                its loss reads the head chunk by chunk (target_logps; distill's
                                     linear_distill), not whole logits: memory.py
        rows(group)                  sequences through the model per batch item (rows_per_item: a DPO pair
                                     2; GRPO: a prompt's group of completions)
        uses_reference(group)        a frozen "reference" (FrozenModel; by default the starting weights) is
                                     built for it (needs_reference; GRPO: only with a KL term)
        frozen_models(group)         the names of the frozen models it reads ("reference", "teacher"):
                                     each is built from its frozen.<name> source, frozen, never trained
        precomputed_models(group)    those whose outputs it reads from the prepared data instead (their
                                     sources checked, none built: dpo.reference=precomputed)
        flops(counts, dense, causal, group)   training FLOPs per token, its own extra work added
        batch_words(n, group), describe(plan)   what start-up says of a batch and of the objective
        model_config(model, source)  the ModelConfig it trains, from the one the run starts with (reward:
                                     a score head added); a reward model's (model.score_head) is refused
                                     as a policy in one line by every other objective
    run time (an instance per run, given the plan and its frozen models by name; self.reference is the
    "reference" one, or None)
        loss(model, batch) -> (loss, weight)   a micro-batch's loss and its loss-token count (None: every
                                               micro-batch weighs the same); it may first produce what it
                                               trains on (GRPO: completions sampled from the model) and
                                               keep it for later steps (several passes over one batch)
        validate(model, batch, rank, world_size, val_sources)   one validation batch, kept on the device
        val_metrics(strategy, val_sources), train_metrics(strategy)   reduced over the ranks, then reset
        progress(metrics), val_progress(metrics), summary(metrics)   what the progress line and the end say
        state(), load_state(state)   what it keeps across steps that a resume needs (in every checkpoint)

A new objective is one file with a subclass and one row of gptkit/training/objectives/__init__.py.
torchtitan's components/loss.py (a loss as a component the trainer calls) is the model.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ClassVar

import torch

from gptkit.errors import GptkitError


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    """The model in eval mode (no dropout) and without autograd, its own mode restored afterwards."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was)


def target_logps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, temperature: float = 1.0):
    """Log-probs [N, T] (fp32) of the targets y [N, T] (-100: none, 0 there) under the model's logits on
    x [N, T] divided by temperature, computed by the model chunk by chunk over the tokens
    (GPT.forward(token_logps=True), gptkit_kernels.linear_ce.linear_log_probs): neither pass holds the
    [N, T, vocab] fp32 logits, which would cap the sequence length and vocabulary of DPO, KTO and GRPO.
    Equal to -F.cross_entropy(logits.float() / temperature, y, reduction="none") (tests/training/test_dpo.py,
    test_grpo.py)."""
    return model(x, y, token_logps=True, temperature=temperature).logps


class FrozenModel:
    """A frozen model an objective measures against, by name: "reference" (DPO's implicit rewards, an RL KL
    term) or "teacher" (objective=distill). Its own ModelConfig and source (frozen.<name>: the policy's
    starting weights, a run folder or checkpoint, an import or hf:, gptkit/training/start.py); the only thing
    it shares with the policy is the vocabulary.

    module: a frozen GPT (the run loads its weights into it), or None with `disabled`, a context-manager
    factory under which the policy itself computes exactly the starting model (LoRA: its adapters off, no
    second copy). Not a submodule of the LightningModule: in no checkpoint and no optimizer; requires_grad
    False and eval mode from the start. `source` records the checkpoint the weights came from, saved with
    every checkpoint, so that a resume measures against the same weights."""

    # the checkpoint entry of the reference's `source` (its name predates other objectives and other frozen
    # models; kept so old runs resume); another frozen model's is gptkit_frozen_<name>
    CHECKPOINT_KEY = "gptkit_dpo_reference"

    def __init__(
        self,
        module: torch.nn.Module | None,
        disabled: Callable[[torch.nn.Module], Any] | None = None,
        name: str = "reference",
    ) -> None:
        self.module, self.disabled, self.name = module, disabled, name
        # {path, step} of the checkpoint the weights came from (set when they are loaded)
        self.source: dict[str, Any] | None = None
        if module is not None:
            module.requires_grad_(False)
            module.eval()

    @property
    def checkpoint_key(self) -> str:
        return self.CHECKPOINT_KEY if self.name == "reference" else f"gptkit_frozen_{self.name}"

    def logits(
        self, policy: torch.nn.Module, x: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The frozen model's logits of x [N, T] -> [N, T, vocab_size]: eval mode, no grad; doc_ids [N, T]
        (packed documents) as the policy's forward takes them."""
        if self.module is not None:
            with evaluating(self.module):
                return self.module(x, doc_ids=doc_ids).logits
        with self.disabled(policy), evaluating(policy):
            return policy(x, doc_ids=doc_ids).logits

    def logps(
        self, policy: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor:
        """The frozen model's log-probs [N, T] of the targets y [N, T] (target_logps, chunked): eval mode, no
        grad."""
        if self.module is not None:
            with evaluating(self.module):
                return target_logps(self.module, x, y, temperature)
        with self.disabled(policy), evaluating(policy):
            return target_logps(policy, x, y, temperature)

    def head_inputs(
        self, policy: torch.nn.Module, x: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
        """What a chunked loss reads of the frozen model in place of its logits: its final hidden states of x
        [N, T] -> [N, T, d_model], its head's weight [vocab_size, d_model] and model.logit_softcap; eval mode,
        no grad. The weight is None when the frozen model is the policy with its adapters off: its head is
        the policy's own (no adapter reaches lm_head), which the loss reads inside the policy's forward (under
        FSDP2 the gathered weight lives only there). A frozen model sharded by FSDP2 gives a copy of its
        gathered head weight (its own is freed when its forward ends)."""

        def grab(h, weight, softcap):
            return h, weight, softcap

        def grab_copy(h, weight, softcap):
            # FSDP2 frees the gathered weight when the frozen model's forward ends (reshard), while the loss
            # reads it in the policy's forward and backward: a copy of its head, [vocab, d_model], is held
            return h, weight.detach().clone(), softcap

        if self.module is not None:
            if getattr(self.module, "_gptkit_sharded", False):
                grab = grab_copy
            with evaluating(self.module):
                return self.module(x, doc_ids=doc_ids, head=grab).head
        with self.disabled(policy), evaluating(policy):
            h, _, softcap = policy(x, doc_ids=doc_ids, head=grab).head
        return h, None, softcap

    def save(self, checkpoint: dict[str, Any]) -> None:
        if self.source is not None:
            checkpoint[self.checkpoint_key] = dict(self.source)

    def check(self, checkpoint: dict[str, Any]) -> None:
        """A resumed run's frozen model must hold the weights the run started with."""
        saved, now = checkpoint.get(self.checkpoint_key), self.source
        if saved and now and int(saved["step"]) != int(now["step"]):
            raise GptkitError(
                f"the {self.name} {now['path']} holds step {now['step']}, but this run "
                f"started from step {saved['step']} of {saved['path']}: the source run trained "
                "on, so a resume would measure against other weights; start a new run"
            )


def frozen_words(plan: Any, name: str, from_start: str) -> str:
    """What the start-up line says of the frozen model `name`: `from_start` when it is the policy's
    starting weights, else its source (plan.frozen: the sources other than the start)."""
    source = (getattr(plan, "frozen", None) or {}).get(name)
    return from_start if source is None else source.describe()


class Objective:
    """One training objective (see the module docstring for the interface). The defaults are a plain
    next-token objective's: no config group, any data kind no other objective claims, one row per item."""

    name: ClassVar[str] = ""
    # its config group (cfg.<group>), or None
    group: ClassVar[str | None] = None
    # the data kinds it trains on, which no other objective reads; None: every kind not claimed so
    data_kinds: ClassVar[tuple[str, ...] | None] = None
    # it starts from weights (init_from=, which a resume keeps in its config)
    needs_start: ClassVar[bool] = False
    needs_reference: ClassVar[bool] = False
    rows_per_item: ClassVar[int] = 1
    # its loss is a positive figure that falls as the model learns, so trainer.spike_factor can judge a step
    # against the median of the steps before (a policy-gradient loss sits around 0 by construction: no)
    loss_spikes: ClassVar[bool] = True
    # its loss reads per-token log-probs the model computes chunk by chunk (target_logps; objective=distill:
    # both heads, linear_distill), never whole logits: the memory estimate counts chunks of them
    # (training/memory.py)
    chunked_logps: ClassVar[bool] = False

    @classmethod
    def check_config(cls, group: Any) -> None:
        """Its config group (None when absent): one-line ConfigErrors for values that cannot train."""

    @classmethod
    def check_run(cls, cfg: Any) -> None:
        """The rest of the run's config as it concerns the objective (after its group, its data and its
        start are checked): one-line ConfigErrors."""

    @classmethod
    def settings_of(cls, cfg: Any) -> Any:
        """Its config group of a run's config (None: no group, or no config)."""
        return cfg.get(cls.group) if cls.group and cfg is not None else None

    @classmethod
    def rows(cls, group: Any) -> int:
        """Sequences through the model per batch item (its config group may decide)."""
        return cls.rows_per_item

    @classmethod
    def uses_reference(cls, group: Any) -> bool:
        """Whether a frozen "reference" is built for it (its config group may decide)."""
        return cls.needs_reference

    @classmethod
    def frozen_models(cls, group: Any) -> tuple[str, ...]:
        """The names of the frozen models it reads (FrozenModel; each from its frozen.<name> source): by
        default "reference" when it uses one. An objective with a teacher adds "teacher"."""
        return ("reference",) if cls.uses_reference(group) else ()

    @classmethod
    def precomputed_models(cls, group: Any) -> tuple[str, ...]:
        """The names of the frozen models whose outputs it reads from the prepared data instead of running
        them (dpo.reference=precomputed): their sources are checked and resolved as frozen_models' are, to
        check that the data's outputs are theirs (gptkit/training/precompute.py), but none is built or
        loaded. By default none."""
        return ()

    @classmethod
    def wrong_data(cls, kind: Any) -> str:
        """The error when the data kind is not one it trains on."""
        return f"objective={cls.name} does not train on data kind {kind!r}"

    @classmethod
    def claimed(cls) -> str:
        """The error when another objective's config names a data kind that only this one reads."""
        return f"that data is for objective={cls.name}"

    @classmethod
    def no_start(cls) -> str:
        """The error when it needs starting weights and the config gives none."""
        return f"objective={cls.name} needs a starting checkpoint: init_from=<run folder or checkpoint>"

    @classmethod
    def flops(cls, counts: Any, dense: float, causal: float, group: Any = None) -> tuple[float, float]:
        """Training FLOPs per token (full-attention and causal conventions) with its own work added: a
        reference's forward (no grad) when it uses one."""
        if cls.uses_reference(group):
            return dense + counts.forward_dense, causal + counts.forward_causal
        return dense, causal

    @classmethod
    def model_config(cls, model: Any, source: str) -> Any:
        """The ModelConfig the run trains, given the one it starts with (`source`: where that came from, for
        the error): unchanged, but a reward model (model.score_head: it scores sequences, it generates
        nothing) is no policy for this objective."""
        if getattr(model, "score_head", False):
            raise GptkitError(
                f"{source} is a reward model (model.score_head: it scores sequences and generates nothing), "
                f"not a policy for objective={cls.name}; start from the run it was trained from, or use it "
                "as a reward (objective=grpo, grpo.rewards=[{kind: model, path: <run>}])"
            )
        return model

    @classmethod
    def batch_words(cls, batch_size: int, group: Any = None) -> str:
        """What one micro-batch of batch_size items is, for the start-up line."""
        return f"{batch_size} sequences"

    @classmethod
    def describe(cls, plan: Any) -> str | None:
        """Its start-up line (None: nothing to say)."""
        return None

    def __init__(self, plan: Any, frozen: dict[str, FrozenModel] | None = None) -> None:
        self.settings = plan.cfg.get(self.group) if self.group else None
        # the frozen models it asked for (frozen_models), by name
        self.frozen = dict(frozen or {})
        self.reference = self.frozen.get("reference")

    def loss(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the loss of one micro-batch, its loss tokens as an int64 scalar on the device, or None when every
        micro-batch weighs the same)."""
        raise NotImplementedError

    def validate(self, model: torch.nn.Module, batch, rank: int, world_size: int, val_sources) -> None:
        """Add one validation batch to the objective's sums, on the device (no host sync)."""
        raise NotImplementedError

    def val_metrics(self, strategy, val_sources) -> dict[str, Any]:
        """The validation's figures over every rank ({} when nothing was validated), then start afresh;
        val_sources as given to validate."""
        return {}

    def train_metrics(self, strategy) -> dict[str, float]:
        """Figures of its own for a log step's row, over every rank (read at log steps only)."""
        return {}

    def progress(self, metrics: dict[str, float]) -> list[str]:
        """Its parts of a log step's progress line."""
        return []

    def val_progress(self, metrics: dict[str, Any]) -> str:
        """What follows `val loss ...` on the progress line after a validation."""
        return ""

    def state(self) -> dict[str, Any] | None:
        """What a resume needs of it (tensors, numbers, lists, dicts: a checkpoint loads with
        weights_only=True); None: nothing."""
        return None

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Take back what state() saved (None: the checkpoint holds nothing of it)."""

    def summary(self, metrics: dict[str, Any]) -> str | None:
        """The final validation in the run's last line (None: no validation yet)."""
        val = metrics.get("val/loss")
        if val is None:
            return None
        return f"val loss {float(val):.4f} (ppl {math.exp(min(float(val), 50)):.2f})"
