"""The optimizers (optim=adamw, optim=muon) with their parameter groups, and learning-rate schedules
(torch LambdaLR).

optim=muon: torch.optim.Muon for the 2-D weights inside the transformer blocks (the attention and MLP
projections), AdamW (the optim=adamw settings) for everything else: the embeddings, the LM head, norms and
biases. Muon's step is lr * 0.2 * sqrt(max(A, B)) times the orthogonalized momentum of an A x B matrix
(adjust_lr_fn="match_rms_adamw", Moonlight, arXiv:2502.16982): an update of AdamW's RMS, so optim.lr, the
schedule and optim.weight_decay (decoupled: w -= lr * weight_decay * w) mean what they mean with AdamW.
Lightning steps one optimizer: MuonWithAdamW holds the two and shows their groups and state as its own.
A mixture of experts' stacked expert weights [n_experts, out, in] (and a LoRA run's expert adapters) are
Muon's too, each expert's matrix orthogonalized on its own with its own lr adjustment (muon_step); under
FSDP2 each rank holds whole experts (rows of dim 0) and orthogonalizes its own.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn
from torch.optim._muon import _adjust_lr

from gptkit.errors import ConfigError
from gptkit.training.config_checks import adamw_implementation, check_optim_values

# torch.distributed (.tensor) is imported inside the Muon step's helpers: ~1.1 s of start-up on the CPU
# (measured 2026-12-01, load ~8), which only optim=muon runs pay, at their first step.

# torch.optim.Muon's adjust_lr_fn
MUON_ADJUST_LR = ("match_rms_adamw", "original")
# the first torch with torch.optim.Muon
MUON_TORCH = "2.9"
# optim.muon.ns_dtype
MUON_NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def param_groups(
    model: nn.Module,
    weight_decay: float,
    decay_embeddings: bool = False,
    decay_norms_and_biases: bool = False,
    named: list | None = None,
) -> list[dict[str, Any]]:
    """Weight decay on weight matrices only; norms, biases and embeddings undecayed unless asked.

    Tied weights appear once (named_parameters de-duplicates them under their first name). `named`: only
    these (name, parameter) pairs (AdamW's share under optim=muon) instead of every trainable one.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters() if named is None else named:
        if not p.requires_grad:
            continue
        is_embedding = name.startswith(("tok_emb.", "pos_emb."))
        # a mixture's expert biases are stacked, [n_experts, out]: biases, not matrices (as in muon_split)
        is_bias = p.ndim < 2 or name.endswith("_bias")
        is_matrix = not is_bias and not is_embedding
        if is_matrix or (is_embedding and decay_embeddings) or (is_bias and decay_norms_and_biases):
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def muon_split(model: nn.Module) -> tuple[list, list]:
    """(Muon's, AdamW's) trainable (name, parameter) pairs: Muon takes the 2-D weights inside the transformer
    blocks and the multi-token prediction modules (attention and MLP projections, MTP's input projection;
    the fused q/k/v projection is one matrix, as torch.optim.Muon sees it), AdamW the rest: token and
    position embeddings, the LM head (tied or not), norms and biases.
    With finetune=lora the trainable 2-D weights in the blocks are the adapters' factors, A [rank, in] and
    B [rows, rank], each orthogonalized on its own (so each step moves A and B by AdamW's RMS, as Muon moves
    a whole matrix), and AdamW has nothing to train."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            # 3-D: a mixture's experts stacked, [n_experts, out, in], a matrix per expert
            # a mixture's expert biases are stacked too, [n_experts, out]: vectors, AdamW's; so is a Gated
            # DeltaNet's depthwise conv1d, [channels, 1, taps]: a few taps per channel, no matrix
            matrix = p.ndim in (2, 3) and not name.endswith(("_bias", "conv1d.weight"))
            # the multi-token prediction modules' (model.mtp) projections and blocks are hidden matrices too
            (muon if name.startswith(("blocks.", "mtp.")) and matrix else adamw).append((name, p))
    return muon, adamw


def check_muon_split(model: nn.Module) -> None:
    """optim=muon on a model without a trainable 2-D weight inside its blocks is a one-line error."""
    muon, _ = muon_split(model)
    if not muon:
        raise ConfigError(
            "optim=muon: the model has no trainable 2-D weight inside its blocks for Muon "
            "(attention and MLP projections); use optim=adamw"
        )


def check_optim_config(cfg: Any) -> None:
    """One-line errors for the `optim` group, before any data is prepared or anything is written: its values
    (config_checks, which fit.check_config runs before importing torch), then Muon's settings."""
    check_optim_values(cfg)
    if cfg.name == "muon":
        check_muon_config(cfg)


def min_lr(cfg: Any) -> float:
    """The lr the schedule decays to: optim.min_lr, or optim.lr / 10 when it is null (the default, so that
    optim.lr=3e-5 alone gives a schedule to 3e-6)."""
    return float(cfg.lr) / 10 if cfg.get("min_lr") is None else float(cfg.min_lr)


def check_muon_config(cfg: Any) -> None:
    """optim.muon.*: torch.optim.Muon present, momentum in [0, 1), ns_steps a positive integer (< 100, torch's
    limit), nesterov a boolean, ns_dtype one of MUON_NS_DTYPES, adjust_lr one of MUON_ADJUST_LR."""
    if not hasattr(torch.optim, "Muon"):
        raise ConfigError(
            f"optim=muon needs torch >= {MUON_TORCH} (torch.optim.Muon); this is torch "
            f"{torch.__version__}: upgrade torch or use optim=adamw"
        )
    m = cfg.muon
    momentum = m.momentum
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ConfigError(f"optim.muon.momentum={momentum} must be a number in [0, 1)")
    steps = m.ns_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
        raise ConfigError(
            f"optim.muon.ns_steps={steps} must be an integer in [1, 99] (Newton-Schulz iterations)"
        )
    if not isinstance(m.nesterov, bool):
        raise ConfigError(f"optim.muon.nesterov={m.nesterov} must be true or false")
    if m.get("ns_dtype", "bfloat16") not in MUON_NS_DTYPES:
        raise ConfigError(
            f"optim.muon.ns_dtype={m.ns_dtype!r} must be one of {', '.join(MUON_NS_DTYPES)} "
            f"(the dtype of Newton-Schulz)"
        )
    if m.adjust_lr not in MUON_ADJUST_LR:
        raise ConfigError(
            f"optim.muon.adjust_lr={m.adjust_lr!r} must be one of {', '.join(MUON_ADJUST_LR)} "
            f"(match_rms_adamw: optim.lr means what it means with AdamW)"
        )


def _adamw(groups: list[dict[str, Any]], cfg: Any, device_type: str) -> torch.optim.AdamW:
    impl = adamw_implementation(cfg.fused, device_type)
    return torch.optim.AdamW(
        groups,
        lr=float(cfg.lr),
        betas=tuple(float(b) for b in cfg.betas),
        eps=float(cfg.eps),
        fused=impl == "fused",
        foreach=impl == "foreach" or None,
    )


def build_optimizer(model: nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """AdamW over param_groups, or (optim=muon) MuonWithAdamW; cfg as check_optim_config accepts it."""
    device_type = next(model.parameters()).device.type
    decay = (float(cfg.weight_decay), bool(cfg.decay_embeddings), bool(cfg.decay_norms_and_biases))
    if cfg.name != "muon":
        return _adamw(param_groups(model, *decay), cfg, device_type)
    check_muon_split(model)
    muon_named, adamw_named = muon_split(model)
    m = cfg.muon
    matrices = [p for _, p in muon_named if p.ndim == 2]
    muon = torch.optim.Muon(
        # (a stand-in when every matrix is an expert stack: replaced below)
        matrices or [torch.empty(1, 1)],
        lr=float(cfg.lr),
        weight_decay=decay[0],
        momentum=float(m.momentum),
        nesterov=bool(m.nesterov),
        ns_steps=int(m.ns_steps),
        adjust_lr_fn=str(m.adjust_lr),
    )
    # torch.optim.Muon checks for 2-D parameters when it is built, not after: a mixture's expert stacks
    # [n_experts, out, in] join the group here, in the model's order (muon_step takes them expert by expert)
    muon.param_groups[0]["params"] = [p for _, p in muon_named]
    groups = [g for g in param_groups(model, *decay, named=adamw_named) if g["params"]]
    # finetune=lora: only Muon's matrices train
    adamw = _adamw(groups, cfg, device_type) if groups else None
    return MuonWithAdamW(
        muon, adamw, ns_dtype=MUON_NS_DTYPES[m.get("ns_dtype", "bfloat16")], fused=qkv_parts(muon_named)
    )


def qkv_parts(named: list) -> dict[int, tuple[str, int]]:
    """trainer.tensor_parallel: the q, k, v weights that a tensor-parallel run's qkv_proj splits the fused
    projection into (training/tensor_parallel.py), {id(parameter): (qkv_proj's name, 0 | 1 | 2)}: Muon
    orthogonalizes each three as the one matrix [q; k; v] a one-process run has."""
    parts = {}
    for name, p in named:
        head, part, leaf = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", "")
        if leaf == "weight" and head.endswith(".qkv_proj") and part in ("q", "k", "v"):
            parts[id(p)] = (head, "qkv".index(part))
    return parts


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon and torch.optim.AdamW as the one optimizer Lightning steps.

    adamw is None when Muon's matrices are all that trains (finetune=lora: the adapters' A and B factors).
    Its param_groups are the two optimizers' groups (the same dicts: Muon's first) and its state is theirs
    (one dict), so the lr scheduler, gradient clipping, the grad scaler and checkpoints (state_dict /
    load_state_dict, FSDP's get/set_optimizer_state_dict) see every parameter once, with its own settings.

    ns_dtype: the dtype of Newton-Schulz. bfloat16 with plain tensors is torch.optim.Muon's own step;
    float32, FSDP2's row-sharded DTensors and bf16 parameters without Nesterov (where torch's step overwrites
    the momentum) take muon_step, the same arithmetic. Under FSDP2, Newton-Schulz
    needs the whole matrix: each rank orthogonalizes its share of the matrices (sharded_ns, the default) or
    every rank every matrix (sharded_ns=False, gathered with full_tensor); the two agree bit for bit.
    """

    def __init__(
        self,
        muon: torch.optim.Optimizer,
        adamw: torch.optim.Optimizer | None,
        ns_dtype: torch.dtype = torch.bfloat16,
        sharded_ns: bool = True,
        fused: dict[int, tuple[str, int]] | None = None,
    ) -> None:
        self.muon, self.adamw = muon, adamw
        # trainer.tensor_parallel: the q, k, v parts of each fused projection (qkv_parts)
        self.fused = fused or {}
        self.ns_dtype, self.sharded_ns = ns_dtype, sharded_ns
        super().__init__(muon.param_groups + (adamw.param_groups if adamw is not None else []), {})
        self._link()

    def _link(self) -> None:
        """Point the two optimizers at this one's groups and state (after __init__ and load_state_dict, which
        replace them)."""
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.muon.state = self.param_groups[:n], self.state
        if self.adamw is not None:
            self.adamw.param_groups, self.adamw.state = self.param_groups[n:], self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [(g, p) for g in self.muon.param_groups for p in g["params"]]
        sharded = any(is_dtensor(p) for _, p in params)
        # torch's step, without Nesterov, divides the momentum buffer of a bf16 parameter in place (its
        # Newton-Schulz normalizes grad.bfloat16(), which is the buffer itself): muon_step does not
        torch_bug = any(not g["nesterov"] and p.dtype == torch.bfloat16 for g, p in params)
        # a mixture's expert stacks: one matrix per expert (torch's step takes 2-D parameters only)
        stacked = any(p.ndim == 3 for _, p in params)
        if sharded or torch_bug or stacked or self.fused or self.ns_dtype != torch.bfloat16:
            muon_step(self.muon, self.ns_dtype, sharded_ns=self.sharded_ns, fused=self.fused)
        else:
            self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        return loss


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def newton_schulz(
    grad: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz orthogonalization of a 2-D `grad`, computed in `dtype`.

    The same quintic iteration as torch's _zeropower_via_newtonschulz, operation for operation (so bfloat16
    gives its result bit for bit): X = grad / ||grad||_F (transposed to the wide side), then `steps` times
    X <- a X + (b X X^T + c (X X^T)^2) X. Returns `dtype`; `grad` is not modified.
    """
    a, b, c = coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.to(dtype)
    x = x.T if tall else x  # [min(A, B), max(A, B)]
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T  # [min, min]
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@torch.no_grad()
def muon_step(
    muon: torch.optim.Optimizer,
    ns_dtype: torch.dtype,
    sharded_ns: bool = True,
    fused: dict[int, tuple[str, int]] | None = None,
) -> None:
    """torch.optim.Muon's step with Newton-Schulz in `ns_dtype`, for plain tensors and FSDP2's DTensors.

    The arithmetic of torch's _single_tensor_muon, with its lr adjustment: momentum and Nesterov
    (elementwise, on the local shards under FSDP2), the update orthogonalized (newton_schulz), then decoupled
    weight decay and the step. A row-sharded DTensor's update is orthogonalized whole: by one rank per matrix
    (sharded_ns: gathered to it, its rows scattered back, orthogonalize_sharded) or by every rank (gathered
    with full_tensor). Collective under FSDP2: every rank calls it, for the same parameters in the same order.
    fused: {id(parameter): (name, index)} of matrices that are parts of one (trainer.tensor_parallel's q, k,
    v: qkv_parts): their updates are stacked in index order, orthogonalized whole (gathered on every rank),
    and each part takes its rows, with the whole matrix's lr adjustment.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    fused = fused or {}
    # row-sharded, for orthogonalize_sharded: (parameter, update, its Newton-Schulz, its group)
    pending = []
    # the parts of fused matrices: name -> {index: (parameter, update, its Newton-Schulz, its group)}
    parts: dict[str, dict[int, tuple]] = {}
    for group in muon.param_groups:
        ns = functools.partial(
            newton_schulz,
            coefficients=group["ns_coefficients"],
            steps=group["ns_steps"],
            eps=group["eps"],
            dtype=ns_dtype,
        )
        for p in group["params"]:
            if p.grad is None:
                continue
            state = muon.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - group["momentum"])
            update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            if id(p) in fused:
                name, index = fused[id(p)]
                parts.setdefault(name, {})[index] = (p, update, ns, group)
                continue
            if update.ndim == 3:
                # a mixture's experts [E, out, in]: each expert's matrix on its own; under FSDP2 a rank's
                # rows of dim 0 are whole experts, so each rank orthogonalizes its own
                local = update.to_local() if is_dtensor(update) else update
                ortho = torch.stack([ns(m) for m in local]) if local.shape[0] else local.to(ns_dtype)
                if is_dtensor(update):
                    ortho = DTensor.from_local(
                        ortho, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                    )
                _apply(p, ortho, group, _adjust_lr)
                continue
            if sharded_ns and _row_sharded(update):
                pending.append((p, update, ns, group))
                continue
            # every rank the whole matrix [A, B], the same result; keeps its own rows
            if is_dtensor(update):
                ortho = distribute_tensor(
                    ns(update.full_tensor()), p.device_mesh, p.placements, src_data_rank=None
                )
            else:
                ortho = ns(update)
            _apply(p, ortho, group, _adjust_lr)
    if pending:
        orthos = orthogonalize_sharded([u for _, u, _, _ in pending], [f for _, _, f, _ in pending], ns_dtype)
        for (p, _, _, group), rows in zip(pending, orthos):
            ortho = DTensor.from_local(
                rows, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            _apply(p, ortho, group, _adjust_lr)
    for by_index in parts.values():
        members = [by_index[i] for i in sorted(by_index)]
        # [rows of q + k + v, d_model], every rank the whole matrix
        whole = torch.cat([u.full_tensor() if is_dtensor(u) else u for _, u, _, _ in members])
        ortho = members[0][2](whole)
        adjust = functools.partial(_whole_adjust, shape=whole.shape)
        for (p, _, _, group), rows in zip(members, torch.split(ortho, [p.shape[0] for p, *_ in members])):
            if is_dtensor(p):
                rows = distribute_tensor(rows.contiguous(), p.device_mesh, p.placements, src_data_rank=None)
            _apply(p, rows, group, adjust)


def _whole_adjust(lr: float, fn: str, _part_shape, shape) -> float:
    """_adjust_lr of the whole matrix `shape` a part belongs to."""
    return _adjust_lr(lr, fn, shape)


def _apply(p: torch.Tensor, ortho: torch.Tensor, group: dict[str, Any], adjust_lr) -> None:
    lr = float(group["lr"])
    p.mul_(1 - lr * group["weight_decay"])
    # an expert stack [E, out, in]: each expert's matrix's adjustment
    p.add_(ortho, alpha=-adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:]))


def _row_sharded(t: torch.Tensor) -> bool:
    """A DTensor sharded by rows over a 1-D mesh (FSDP2's layout), whose local rows are torch.chunk's."""
    if not is_dtensor(t):
        return False
    from torch.distributed.tensor import Shard

    mesh = t.device_mesh
    return (
        mesh.ndim == 1
        and tuple(t.placements) == (Shard(0),)
        and t.to_local().shape[0] == _chunk_rows(t.shape[0], mesh.size())[mesh.get_local_rank()]
    )


def _chunk_rows(rows: int, world: int) -> list[int]:
    """Rows per rank of torch.chunk(rows, world) (what Shard(0) keeps), 0 for ranks past the last chunk."""
    per = -(-rows // world)
    return [max(0, min(per, rows - r * per)) for r in range(world)]


def orthogonalize_sharded(updates: list, orthogonalize: list, dtype: torch.dtype) -> list[torch.Tensor]:
    """Newton-Schulz of row-sharded DTensors [A, B], each matrix on one rank: this rank's rows of each result.

    Matrix i belongs to rank i % world: every rank's rows of it are gathered there (padded to the chunk
    size), each owner orthogonalizes its matrices (orthogonalize[i], returning `dtype`; each rank 1/world of
    the work, at the same time), and each result's rows are scattered back to the ranks that hold them. The
    same function of the same whole matrix as gathering it on every rank, so the same result bit for bit; a
    rank holds only its own matrices whole. Collective: every rank calls it with the same matrices in order.
    """
    import torch.distributed as dist

    group = updates[0].device_mesh.get_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = [(i % world, _chunk_rows(u.shape[0], world)) for i, u in enumerate(updates)]
    ortho = {}
    for i, (u, (owner, rows)) in enumerate(zip(updates, layout)):
        local = _pad_rows(u.to_local(), max(rows)).contiguous()  # [ceil(A / world), B]
        gathered = [torch.empty_like(local) for _ in range(world)] if rank == owner else None
        dist.gather(local, gathered, group=group, group_dst=owner)
        if rank == owner:
            ortho[i] = torch.cat([g[:n] for g, n in zip(gathered, rows)])  # [A, B]
    # this rank's share of the work
    ortho = {i: orthogonalize[i](whole) for i, whole in ortho.items()}
    mine = []
    for i, (u, (owner, rows)) in enumerate(zip(updates, layout)):
        # the owner's result in row blocks, contiguous (a tall matrix's result is transposed)
        parts = None
        if rank == owner:
            parts = [_pad_rows(t, max(rows)).contiguous() for t in torch.split(ortho.pop(i), rows)]
        local = torch.empty(max(rows), u.shape[1], dtype=dtype, device=u.to_local().device)
        dist.scatter(local, parts, group=group, group_src=owner)
        mine.append(local[: rows[rank]])  # [this rank's rows, B]
    return mine


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def describe_optimizer(cfg: Any, model: nn.Module, device_type: str) -> str:
    """The start-up line's optimizer part: which optimizer trains how many parameters (tied weights once)."""
    adamw = f"AdamW ({adamw_implementation(cfg.fused, device_type)})"
    if cfg.name != "muon":
        return adamw
    muon, rest = muon_split(model)
    n = lambda named: sum(p.numel() for _, p in named)  # noqa: E731
    # an expert stack [E, out, in] is E matrices
    matrices = sum(p.shape[0] if p.ndim == 3 else 1 for _, p in muon)
    m = cfg.muon
    return (
        f"Muon (torch.optim.Muon: {n(muon):,} parameters in {matrices:,} block matrices; momentum "
        f"{m.momentum}{' nesterov' if m.nesterov else ''}, {m.ns_steps} Newton-Schulz steps in "
        f"{m.get('ns_dtype', 'bfloat16')}, lr x "
        f"{'0.2·sqrt(max(A, B))' if m.adjust_lr == 'match_rms_adamw' else 'sqrt(max(1, A/B))'})"
        + (
            f" + {adamw} for {n(rest):,} parameters in {len(rest)} tensors (embeddings, head, norms, biases)"
            if rest
            else "; nothing else trains"
        )
    )


def lr_factor(
    step: int,
    *,
    schedule: str,
    max_steps: int,
    warmup_steps: int,
    lr: float,
    min_lr: float,
    decay_fraction: float = 0.2,
) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based).

    warmup: linear from lr/warmup to lr over `warmup_steps`; then
      cosine:   cosine decay to min_lr at max_steps
      linear:   linear decay to min_lr at max_steps
      wsd:      warmup-stable-decay: flat at lr, then linear to min_lr over the last decay_fraction of steps
      constant: flat at lr
    """
    floor = min_lr / lr
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if step >= max_steps:
        return floor
    if schedule == "wsd":
        decay_start = max(warmup_steps, int(max_steps * (1 - decay_fraction)))
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, max_steps - decay_start)
        return 1.0 - (1.0 - floor) * progress
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    if schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: Any, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The LambdaLR of optim.schedule (warmup, then cosine / linear / WSD to optim.min_lr)."""
    kw = dict(
        schedule=cfg.schedule,
        max_steps=max_steps,
        warmup_steps=int(cfg.warmup_steps),
        lr=float(cfg.lr),
        min_lr=min_lr(cfg),
        decay_fraction=float(cfg.decay_fraction),
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, **kw))
