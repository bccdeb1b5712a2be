"""trainer.ema=<decay>: an exponential moving average of the trained weights, kept beside them.

After every optimizer step (before that step's checkpoint is written: the callback runs before
RunCheckpoints), each trained parameter's average moves towards it: ema = lerp(ema, p, 1 - decay) in fp32,
whatever the parameters' dtype; it starts equal to the weights the training starts from. The averages
travel in the checkpoint (the callback's state: {"decay", "updates", "ema": {name: fp32 tensor}}; tied
parameters share one tensor under each of their names), so a resume continues them bitwise.

At each validation the averages are swapped into the model, the validation windows scored with them
(val/loss_ema, and each of the objective's other figures with an _ema suffix), and the weights swapped back
before the validation of the raw weights runs (val/loss): both rows of the same step.

`gptkit merge run=<run> ema=true` writes a checkpoint's averages as a new run folder, which `eval`,
`sample` and `export` then read like any run (docs/merging.md). Sharded training (trainer=fsdp) is refused
for now (config_checks.check_ema): the averages of the local shards would be exact, but the sharded
checkpoint does not carry a callback's tensors yet.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from gptkit.training.metrics import optimizer_stepped

# the checkpoint's entry (Lightning stores a callback's state under its state_key)
STATE_KEY = "EMA"


class EMA(Callback):
    def __init__(self, decay: float) -> None:
        self.decay = float(decay)
        # {name: fp32 tensor} of each trained parameter (a tied one under its first name)
        self.ema: dict[str, torch.Tensor] | None = None
        # {other name of a tied parameter: its first name} (the merge writes the average under both)
        self.aliases: dict[str, str] = {}
        self.updates = 0

    @property
    def state_key(self) -> str:
        return STATE_KEY

    @staticmethod
    def _params(pl_module) -> dict[str, torch.nn.Parameter]:
        """The trained parameters, each once (a tied one under its first name)."""
        return {n: p for n, p in pl_module.model.named_parameters() if p.requires_grad}

    def on_train_start(self, trainer, pl_module) -> None:
        """A new run (or a resume of a run trained without trainer.ema): the averages start at the weights."""
        params = self._params(pl_module)
        first = {id(p): n for n, p in params.items()}
        self.aliases = {
            n: first[id(p)]
            for n, p in pl_module.model.named_parameters(remove_duplicate=False)
            if id(p) in first and first[id(p)] != n
        }
        if self.ema is None:
            self.ema = {n: p.detach().to(torch.float32, copy=True) for n, p in params.items()}
        else:
            device = next(iter(params.values())).device
            self.ema = {n: t.to(device) for n, t in self.ema.items()}
        missing = sorted(set(params) ^ set(self.ema))
        if missing:
            from gptkit.errors import GptkitError

            raise GptkitError(
                f"the checkpoint's EMA (trainer.ema) does not match the model's trained parameters "
                f"({missing[:3]}); resume with the run's own model and fine-tune"
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """After an optimizer step: each average moves towards its parameter."""
        if not optimizer_stepped(trainer, batch_idx):
            return
        weight = 1.0 - self.decay
        with torch.no_grad():
            for n, p in self._params(pl_module).items():
                self.ema[n].lerp_(p.detach().to(torch.float32), weight)
        self.updates += 1

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        """Score the validation windows with the averages swapped in (then the weights back): val/loss_ema."""
        if trainer.sanity_checking or self.ema is None:
            return
        params = self._params(pl_module)
        objective = pl_module.objective
        loaders = trainer.val_dataloaders
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        rank, world = trainer.global_rank, trainer.world_size
        sources = pl_module._val_sources()
        raw = {n: p.detach().clone() for n, p in params.items()}
        was_training = pl_module.model.training
        with torch.no_grad():
            try:
                for n, p in params.items():
                    p.copy_(self.ema[n])
                pl_module.model.eval()
                with trainer.precision_plugin.val_step_context():
                    for loader in loaders:
                        for batch in loader:
                            batch = pl_module.transfer_batch_to_device(batch, pl_module.device, 0)
                            objective.validate(pl_module.model, batch, rank, world, sources)
                metrics = objective.val_metrics(trainer.strategy, sources)
            finally:
                for n, p in params.items():
                    p.copy_(raw[n])
                pl_module.model.train(was_training)
        for key, value in metrics.items():
            pl_module.log(f"{key}_ema", value, sync_dist=False)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "ema": self.ema, "aliases": self.aliases}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.updates = int(state_dict.get("updates", 0))
        self.ema = state_dict.get("ema")
