"""A plan per mesh: the memory per GPU and the communication per step of a model on n GPUs arranged as
data (FSDP) x context x tensor parallel groups (and expert parallel groups inside them), from the config
alone (no torch): `gptkit count-params`, the run plan's estimate (training/memory.py) and `gptkit preflight`
read it. The formulas and their sources are in docs/parallelism.md.

    n_gpus = dp x cp x tp       FSDP shards the weights over dp x cp = n_gpus / tp (torchtitan's
                                dp_shard x cp mesh), tensor parallelism splits each matrix over tp
    ep                          a mixture's experts over groups of ep of the dp x cp ranks

Memory per GPU: weights, gradients and optimizer state as training_memory counts them, with the matrices
(and the vocabulary-parallel embedding and head) over tp x FSDP = n_gpus and the norms over FSDP only;
activations and logits over tp x cp (sequence parallelism splits what TP leaves whole; CP splits the
sequence); with cp > 1 the ring's K/V chunks in flight (the one sent and the one received).

Communication: the bytes one GPU sends per micro-step (forward and backward), by kind, each collective counted
as the bandwidth-optimal ring sends (an all-gather or reduce-scatter (k-1)/k of the tensor, an all-reduce
2 (k-1)/k); tests/training/test_comm_count.py checks every kind against the bytes counted on gloo
(tests/training/comm_count.py):

    tp     per block 2 all-gathers + 2 reduce-scatters of [b, T/cp, d] forward, as many backward, 3 more in a
           recomputed block; the embedding and head 4; loss_parallel's 3 all-reduces of [b, T/cp] fp32 and
           the replicated weights' gradients (Korthikanti et al. 2022, sequence parallelism; DTensor's plan)
    cp     per attention layer each rank passes its K,V chunk on cp-1 times forward (and when recomputed),
           K,V cp-1 times and dK,dV (fp32) cp times backward (ring attention, Liu et al. 2023)
    fsdp   every unit's weights all-gathered forward and again backward (reshard_after_forward), the
           gradients reduce-scattered (fp32), each sending (f-1)/f of a tensor-parallel rank's share over
           f = dp x cp ranks (ZeRO-3)
    ep     per MoE layer the rows-per-expert counts, then two all-to-alls (dispatch, combine) of
           T/cp x b x top_k tokens of d_model forward, two backward, each sending (ep-1)/ep of it with an
           even routing (GShard, DeepSpeed-MoE)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from gptkit import accounting as acc
from gptkit.errors import ConfigError
from gptkit.model.config import ModelConfig
from gptkit.precision import precision


@dataclass(frozen=True)
class Mesh:
    n_gpus: int
    tp: int = 1
    cp: int = 1
    # expert parallel group size (None: the experts sharded with the rest)
    ep: Optional[int] = None

    @property
    def dp(self) -> int:
        """The data-parallel degree: n_gpus / (tp x cp)."""
        return self.n_gpus // (self.tp * self.cp)

    @property
    def fsdp(self) -> int:
        """The ranks FSDP shards over: dp x cp."""
        return self.n_gpus // self.tp


# how `train` names the mesh's dimensions
MESH_KEYS = (
    "trainer.devices x trainer.num_nodes",
    "trainer.tensor_parallel",
    "trainer.context_parallel",
    "trainer.seq_len",
)


def _degree(value: Any, name: str) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value} must be an integer >= 1")
    return value


def check_mesh(
    model: ModelConfig,
    n_gpus: int,
    tp: Any = 1,
    cp: Any = 1,
    ep: Any = None,
    seq_len: Optional[int] = None,
    keys: tuple[str, str, str, str] = ("n_gpus", "tensor_parallel", "context_parallel", "seq_len"),
) -> Mesh:
    """The Mesh of n_gpus x tp x cp (x ep) for `model`, or a one-line ConfigError naming the dimension that
    does not divide. keys: how the caller names n_gpus, tp, cp and the sequence (count-params' or
    trainer.*)."""
    world, tp_key, cp_key, seq_key = keys
    tp, cp = _degree(tp, tp_key), _degree(cp, cp_key)
    if tp * cp > n_gpus:
        raise ConfigError(
            f"{tp_key}={tp} x {cp_key}={cp} = {tp * cp} GPUs is a mesh larger than the world, "
            f"{world}={n_gpus}"
        )
    if n_gpus % (tp * cp):
        raise ConfigError(f"{tp_key}={tp} x {cp_key}={cp} = {tp * cp} does not divide {world}={n_gpus}")
    if tp > 1:
        widths = [("model.n_heads", model.n_heads)]
        if tp % model.n_kv_heads:
            # fewer K/V heads than ranks: replicated (tensor_parallel.kv_layout) when they divide tp
            widths.append(("model.n_kv_heads", model.n_kv_heads))
        if model.moe is None or len(model.moe_layers) < model.n_layers:
            widths.append(("model.d_ff", model.d_ff))
        for name, width in widths:
            if width % tp:
                raise ConfigError(f"{name}={width} is not divisible by {tp_key}={tp}")
    T = seq_len or model.max_seq_len
    if cp > 1 and T % (2 * cp):
        raise ConfigError(
            f"{seq_key}={T} is not divisible by 2 x {cp_key}={cp} = {2 * cp} (each rank holds two chunks "
            f"of the sequence, one early and one late, to balance causal attention)"
        )
    if ep is not None and ep != 1:
        ep = _degree(ep, "expert_parallel")
        if model.moe is None:
            raise ConfigError(f"expert_parallel={ep} needs a mixture of experts (model.moe)")
        if (n_gpus // tp) % ep:
            raise ConfigError(f"expert_parallel={ep} does not divide the dp x cp ranks, {n_gpus // tp}")
        if model.moe.n_experts % ep:
            raise ConfigError(f"expert_parallel={ep} must divide model.moe.n_experts={model.moe.n_experts}")
    else:
        ep = None
    return Mesh(n_gpus, tp, cp, ep)


def memory_per_gpu(
    model: ModelConfig,
    mesh: Mesh,
    precision_name: Any,
    micro_batch: int,
    seq_len: Optional[int],
    fsdp: bool = True,
    **kw,
) -> dict[str, float]:
    """training_memory (kw: checkpointing, its policy and every, optimizer, lora, frozen) per GPU of
    `mesh` (module docstring); fsdp False: the weights replicated over dp x cp (DDP). A mesh of one
    dimension (tp = cp = 1) is training_memory's own figures."""
    shards = (mesh.fsdp if fsdp else 1) * mesh.tp
    mem = acc.training_memory(
        model, precision_name, shards, micro_batch, seq_len, expert_shards=mesh.ep, **kw
    )
    if mesh.tp > 1:
        # the norms are whole on every tp rank: n_gpus / fsdp = tp times their even share
        pc = acc.count_params(model)
        rest = pc.norms + pc.final_norm
        factor = (pc.total + rest * (mesh.tp - 1)) / pc.total
        for key in ("weights", "gradients", "optimizer", *kw.get("frozen", ())):
            mem[key] *= factor
    split = mesh.tp * mesh.cp
    mem["activations"] /= split
    mem["logits"] /= split
    if mesh.cp > 1:
        p = precision(precision_name, "precision")
        width = 4 if p.compute == "fp32" else 2
        T = seq_len or model.max_seq_len
        # K and V of this rank's chunk, the one being sent and the one arriving
        mem["ring_kv"] = 2 * 2 * micro_batch * (T / mesh.cp) * (model.d_kv / mesh.tp) * width
    mem["total"] = sum(v for k, v in mem.items() if k != "total")
    return mem


def recomputed_layers(
    model: ModelConfig, checkpointing: Optional[str], policy: str = "ops", every: int = 2
) -> int:
    """How many blocks run their forward again in the backward (training/activations.apply): every one
    under full and the selective ops and attention policies, every `every`-th under selective layers."""
    if checkpointing is None:
        return 0
    if checkpointing == "selective" and policy == "layers":
        return len(range(0, model.n_layers, every))
    return model.n_layers


def tp_held(model: ModelConfig, tp: int, experts: bool = True) -> float:
    """The parameters one tensor-parallel rank holds before FSDP shards them: the matrices (and the
    vocabulary-parallel embedding and head) / tp, the norms whole, and the K/V projections whole where
    n_kv_heads < tp (replicated: tensor_parallel.kv_layout). experts False: the experts left out."""
    pc = acc.count_params(model)
    total = pc.total - (0 if experts else pc.experts)
    if tp == 1:
        return total
    whole = pc.norms + pc.final_norm + (_replicated_kv(model) if model.n_kv_heads % tp else 0)
    return (total - whole) / tp + whole


def _replicated_kv(model: ModelConfig) -> int:
    """The K and V projections' weights of every layer (replicated over the tensor-parallel ranks when there
    are fewer K/V heads than ranks)."""
    return model.n_layers * 2 * model.d_model * model.d_kv


def communication(
    model: ModelConfig,
    mesh: Mesh,
    precision_name: Any,
    micro_batch: int,
    seq_len: Optional[int],
    fsdp: bool = True,
    recomputed: int = 0,
) -> dict[str, float]:
    """Bytes one GPU sends per micro-step (forward and backward), by kind (module docstring; checked against
    the bytes counted in a gloo run: tests/training/test_comm_count.py), and their total. fsdp False (DDP):
    the gradients all-reduced over the dp x cp replicas (2 (r-1)/r of them, fp32) in place of FSDP's gathers
    and reduce-scatters. recomputed: the blocks whose forward the backward runs again (activation
    checkpointing: recomputed_layers), which repeats their TP collectives and ring passes."""
    p = precision(precision_name, "precision")
    width = 4 if p.compute == "fp32" else 2
    T = seq_len or model.max_seq_len
    L, d = model.n_layers, model.d_model
    # this rank's tokens: its share of the sequence
    tokens = micro_batch * T / mesh.cp
    out: dict[str, float] = {}
    if mesh.tp > 1:
        tp = mesh.tp
        # [b, T/cp, d] all-gathers and reduce-scatters: per block 2 + 2 forward and 2 + 2 backward; the
        # embedding (a reduce-scatter, its backward an all-gather) and the head (an all-gather, its backward a
        # reduce-scatter); a recomputed block its 2 all-gathers and the attention's reduce-scatter again (the
        # recomputation stops after the last tensor the backward keeps, before the MLP's reduce-scatter)
        collectives = 8 * L + 4 + 3 * recomputed
        seq = collectives * (tp - 1) / tp * tokens * d * width
        # loss_parallel: 3 all-reduces of [b, T/cp] fp32 (the row max, the sum of exponentials, the target's
        # logit); the replicated weights' gradients (norms; K/V where n_kv_heads < tp) all-reduced
        loss = 3 * 2 * (tp - 1) / tp * tokens * 4
        pc = acc.count_params(model)
        whole = pc.norms + pc.final_norm + (_replicated_kv(model) if model.n_kv_heads % tp else 0)
        out["tp"] = seq + loss + 2 * (tp - 1) / tp * whole * width
    if mesh.cp > 1:
        # K and V of this rank's chunk: forward passed on cp - 1 times (and again in a recomputed block);
        # backward K, V cp - 1 times and the dK, dV accumulators (fp32) cp times, the last bringing them home
        kv = 2 * tokens * (model.d_kv / mesh.tp)
        per_layer = 2 * (mesh.cp - 1) * kv * width + mesh.cp * kv * 4
        out["cp"] = L * per_layer + recomputed * (mesh.cp - 1) * kv * width
    f = mesh.fsdp
    if f > 1 and not fsdp:
        out["dp_all_reduce"] = 2 * (f - 1) / f * tp_held(model, mesh.tp) * 4
    elif f > 1:
        pc = acc.count_params(model)
        # the experts of an expert-parallel run are not FSDP's (trainer.expert_parallel)
        held = tp_held(model, mesh.tp, experts=not mesh.ep)
        gathered = p.weight_bytes if p.compute == "fp32" else 2
        # every unit, the root included, gathered for the forward and again for the backward
        out["fsdp_all_gather"] = 2 * (f - 1) / f * held * gathered
        out["fsdp_reduce_scatter"] = (f - 1) / f * held * 4
        if mesh.ep:
            # the experts' gradients all-reduced over the f / ep replicas of each expert group
            r = f // mesh.ep
            out["ep_gradients"] = 2 * (r - 1) / r * pc.experts / mesh.ep * 4 if r > 1 else 0.0
    if mesh.ep and model.moe is not None:
        moe_layers = len(model.moe_layers)
        ep, E = mesh.ep, model.moe.n_experts
        # per MoE layer: the rows-per-expert counts (int64, forward), then the dispatch and combine
        # all-to-alls forward and backward, (ep-1)/ep of the routed rows each when the routing is even
        rows = tokens * model.moe.top_k
        out["ep"] = moe_layers * (ep - 1) / ep * (4 * rows * d * width + E * 8)
    out["total"] = sum(out.values())
    return out
