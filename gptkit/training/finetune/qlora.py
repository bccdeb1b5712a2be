"""finetune=qlora (Dettmers et al., arXiv:2305.14314): LoRA's adapters (lora.py, the `lora` group) on a frozen
base whose block projections are NF4 (torchao's NF4Tensor, gptkit/quant.py; the `qlora` group: blocks of 64
values, double-quantized scales), dequantized in each matmul; embeddings, norms, the LM head and the adapters
stay in the training precision.

The model is built on the meta device (no full-precision copy is ever allocated) and materialize() puts the
weights in place in configure_model, after FSDP2 sharded it: each weight is read from the base checkpoint
(memory-mapped) and quantized on its own, then kept whole (one process, DDP) or as this rank's rows (FSDP2:
NF4 shards, as torchtune loads them; every rank quantizes the same full weight, so the shards put together
are the one-process NF4 weight). A checkpoint holds the adapters only: a resume quantizes the base again from
the same checkpoint, bit for bit (quantization is deterministic), and the adapters' checkpoint record names
the quantization, so that sample, eval, chat and export merge the adapters into dequantize(NF4(W)), the base
they trained on (gptkit.checkpoints.checked_model_state).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gptkit import adapters, quant
from gptkit.checkpoints import STATE_PREFIX, checked_model_state
from gptkit.model import GPT
from gptkit.training.finetune.lora import LoRA, apply_lora


def _settings(cfg: Any) -> tuple[Any, Any]:
    """(qlora.block_size, qlora.scaler_block_size)."""
    q = cfg.get("qlora") or {}
    return q.get("block_size", quant.NF4_BLOCK), q.get("scaler_block_size", "auto")


def param_dtype(precision: Any) -> torch.dtype:
    """The dtype a run keeps its weights in: fp32 (32-true and the mixed precisions), else the compute
    dtype."""
    from gptkit.precision import torch_dtype

    return torch.float32 if precision.weight_bytes == 4 else torch_dtype(precision.compute)


class QLoRA(LoRA):
    """finetune=qlora: LoRA's adapters on an NF4 base (see the module docstring)."""

    name = "qlora"
    title = "QLoRA"
    materializes = True
    FIXED = LoRA.FIXED + (("qlora", ("block_size", "scaler_block_size")),)

    @classmethod
    def check_config(cls, cfg: Any, has_weights: bool) -> None:
        super().check_config(cfg, has_weights)
        quant.check_nf4_settings(*_settings(cfg))
        # its absence: one line naming the extra
        quant.require_torchao()

    @classmethod
    def check_model(cls, cfg: Any, model_cfg: Any) -> None:
        """LoRA's settings, then the NF4 blocks against every projection (and FSDP2's shards of them)."""
        from gptkit.training.distributed import world_size

        super().check_model(cfg, model_cfg)
        t = cfg.get("trainer") or {}
        shards = world_size(t) if t and str(t.get("strategy")) == "fsdp" else 1
        quant.check_nf4(model_cfg, *_settings(cfg), shards=shards)

    @classmethod
    def memory(cls, plan: Any, mem: dict[str, float]) -> dict[str, float]:
        """The base's projections in NF4 and the rest in the weights' dtype, the adapters beside them (their
        gradients and AdamW moments as LoRA's), plus one projection dequantized for its matmul."""
        from gptkit import accounting as acc

        mem = super().memory(plan, mem)
        width = {4: "fp32", 2: "bf16"}[plan.precision.weight_bytes]
        base = acc.quantized_weights(plan.model, "nf4", width, *_settings(plan.cfg))
        k = adapters.adapter_params(plan.model, plan.lora["targets"], plan.lora["rank"])
        largest = max(out * n_in for out, n_in in quant.quantized_names(plan.model).values())
        compute = 4 if plan.precision.compute == "fp32" else 2
        mem["weights"] = (base["total"] + k * plan.precision.weight_bytes) / plan.shards + largest * compute
        return mem

    @classmethod
    def base_words(cls, plan: Any) -> str:
        block, scaler = _settings(plan.cfg)
        return (
            f", its block projections NF4 (blocks of {block}, scales double-quantized in groups of "
            f"{'up to ' + str(quant.NF4_SCALER_BLOCK) if scaler in (None, 'auto') else scaler})"
        )

    def __init__(self, plan: Any) -> None:
        super().__init__(plan)
        self.block_size, self.scaler = _settings(plan.cfg)
        self.dtype = param_dtype(plan.precision)
        # what the loaders need to rebuild the base the adapters trained on
        self.record["finetune"] = self.name
        self.record["quantized"] = {
            "format": "nf4",
            "block_size": self.block_size,
            "scaler_block_size": self.scaler,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def apply(self, model: GPT) -> int:
        """On the meta-built model: LoRA's adapters, and every block projection an NF4 parameter (still on the
        meta device: FSDP2 sees NF4 weights when it shards them; materialize() fills them)."""
        trainable = apply_lora(model, self.plan.lora)
        for name in quant.quantized_names(model.cfg):
            linear = model.get_submodule(name.removesuffix(".weight"))
            weight = linear.weight.detach().to(self.dtype)
            linear.weight = nn.Parameter(
                quant.to_nf4(weight, self.block_size, self.scaler), requires_grad=False
            )
        return trainable

    @torch.no_grad()
    def materialize(self, module: Any, device: Any) -> None:
        """The weights of the meta-built module.model on `device`: the base checkpoint's (memory-mapped, names
        and shapes checked), the block projections quantized to NF4 one at a time; fresh adapters (A
        kaiming-uniform from a generator seeded with the run's seed, so every rank draws the same; B zeros);
        under FSDP2 each rank keeps its rows. A resume then loads the adapters over them."""
        from torch.distributed.tensor import DTensor

        model = module.model
        # a reward model's new score head (adapters.whole_keys): N(0, init_std) from the generator
        whole = adapters.whole_keys(model.cfg)
        state = checked_model_state(self.plan.lora_base, model.cfg, whole)
        quantized = quant.quantized_names(model.cfg)
        generator = torch.Generator().manual_seed(int(self.plan.cfg.seed))
        new: dict[str, nn.Parameter] = {}
        for name, p in model.named_parameters():
            if adapters.is_adapter_key(name):
                full = torch.zeros(p.shape, dtype=self.dtype)  # [rank, in] or [rows, rank]
                if name.endswith("_A"):
                    nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
                full = full.to(device)
            elif name in whole and name not in state:
                full = torch.empty(p.shape, dtype=self.dtype)  # [1, d_model]
                full.normal_(0.0, model.cfg.init_std, generator=generator)
                full = full.to(device)
            elif name in quantized:
                source = state[name].to(device=device, dtype=self.dtype)  # [out, in]
                full = quant.to_nf4(source, self.block_size, self.scaler)
                del source
            else:
                full = state[name].to(device=device, dtype=self.dtype, copy=True)
            value = _shard(full, p) if isinstance(p, DTensor) else full
            new[name] = nn.Parameter(value, requires_grad=p.requires_grad)
        if model.cfg.tie_embeddings:
            new["lm_head.weight"] = new["tok_emb.weight"]
        # FSDP2 takes the new shards through its load_state_dict hook
        model.load_state_dict(new, strict=False, assign=True)
        del state, new
        # buffers: RoPE's tables are recomputed on the device (RotaryEmbedding._apply)
        for m in model.modules():
            if any(b.is_meta for b in m.buffers(recurse=False)):
                m.to_empty(device=device, recurse=False)
        # DDP: the NF4 weights are the same on every rank (each quantizes the same checkpoint) and frozen;
        # nothing broadcasts or reduces them
        module._ddp_params_and_buffers_to_ignore = [STATE_PREFIX + n for n in quantized]


def _shard(full: torch.Tensor, like: Any) -> Any:
    """This rank's rows of `full` as a DTensor laid out as FSDP2's sharded parameter `like` (Shard(0) over
    its mesh): torch.chunk's rows, copied so that the full tensor can go (an NF4 weight: its blocks and
    scales)."""
    from torch.distributed.tensor import DTensor

    mesh = like.device_mesh
    rank = mesh.get_local_rank()
    chunks = torch.chunk(full, mesh.size(), dim=0)
    if rank < len(chunks):
        chunk = chunks[rank]
        local = chunk.new_zeros(chunk.size())
        local.copy_(chunk)
    else:
        local = full.new_zeros((0, *full.shape[1:]))
    return DTensor.from_local(
        local, mesh, like.placements, run_check=False, shape=full.shape, stride=full.stride()
    )
