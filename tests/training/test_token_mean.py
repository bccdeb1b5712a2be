"""Every loss token of an optimizer step weighs the same (gptkit/training/token_mean.py): gradient
accumulation over micro-batches with unequal numbers of loss tokens, and 2 ranks (DDP, FSDP2), give the
gradient of one batch of all of them; train/loss is the per-token mean of the step. Budget: ~10 s of CPU
(most of it the two rank processes starting)."""

import logging
import warnings

import lightning as L
import token_mean_distributed as w
import torch
from conftest import run_two_ranks
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from gptkit.conf_tree import compose
from gptkit.model import ModelConfig
from gptkit.training.module import LitGPT
from gptkit.training.plan import make_plan
from gptkit.training.trainer import build_trainer

TOL = 1e-6


class Batches(L.LightningDataModule):
    def __init__(self, batches) -> None:
        super().__init__()
        self.batches = batches

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None)

    def val_dataloader(self):
        return DataLoader(self.batches[:1], batch_size=None)


def one_step(tmp_path, batches, accumulation: int):
    """One optimizer step of LitGPT through gptkit's trainer factory over `batches` (accumulation
    micro-batches): (the gradients the clipping sees, the logged train/loss)."""
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    m = w.MODEL
    cfg = compose(
        "train",
        [
            "model=llama-tiny",
            f"model.n_layers={m['n_layers']}",
            f"model.d_model={m['d_model']}",
            f"model.n_heads={m['n_heads']}",
            f"model.n_kv_heads={m['n_kv_heads']}",
            f"model.d_ff={m['d_ff']}",
            f"model.max_seq_len={w.T}",
            f"model.vocab_size={m['vocab_size']}",
            "model.attention=eager",
            f"trainer.batch_size={len(batches[0][0])}",
            f"trainer.accumulate_grad_batches={accumulation}",
            "trainer.max_steps=1",
            "trainer.log_every=1",
            "trainer.progress=off",
            "trainer.val_every=1000",
            "trainer.checkpoint_every=1000",
            "optim.warmup_steps=0",
        ],
    )
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    plan = make_plan(cfg, tmp_path, ModelConfig.from_dict(OmegaConf.to_container(cfg.model)))
    module = LitGPT(plan)
    module.model.load_state_dict(w.model().state_dict())
    seen = {}
    clip = module.configure_gradient_clipping

    # after TokenMean.finish, before clipping
    def record(optimizer, *args, **kwargs):
        seen.update({k: p.grad.clone() for k, p in module.model.named_parameters()})
        return clip(optimizer, *args, **kwargs)

    module.configure_gradient_clipping = record
    trainer, _, metrics = build_trainer(plan, [])
    trainer.fit(module, datamodule=Batches(batches))
    return seen, metrics.last["train/loss"]


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def test_accumulating_unequal_micro_batches_is_one_batch_of_both(tmp_path):
    # 2 micro-batches of 4 rows: 31 and 25 loss tokens of 64
    micro = w.micro_batches()
    # one batch of 8 rows
    both = [tuple(torch.cat(t) for t in zip(*micro))]
    want = w.reference_grads()
    one, one_loss = one_step(tmp_path / "one", both, accumulation=1)
    two, two_loss = one_step(tmp_path / "two", micro, accumulation=2)
    assert max_diff(one, want) < TOL
    assert max_diff(two, want) < TOL
    # the logged loss is the per-token mean of the step, as one batch of both
    assert abs(two_loss - one_loss) < TOL
    # the data can tell: a mean of the two micro-batch means is another gradient and another loss
    model = w.model()
    loss = sum(model(x, y).loss for x, y in micro) / 2
    loss.backward()
    naive = {k: p.grad for k, p in model.named_parameters()}
    assert max_diff(naive, want) > 1e3 * TOL
    assert abs(loss.item() - one_loss) > 1e3 * TOL


def test_two_ranks_ddp_and_fsdp2_give_the_one_process_gradient(tmp_path):
    run_two_ranks("token_mean_distributed.py", tmp_path)
    want = w.reference_grads()
    for run in ("ddp", "fsdp"):
        got = torch.load(tmp_path / f"{run}.pt", weights_only=True)
        assert max_diff(got, want) < TOL, run
