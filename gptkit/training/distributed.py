"""Multi-device training: world size, up-front checks, the Lightning strategy and FSDP2 sharding.
(Reading and consolidating sharded checkpoints is gptkit.checkpoints'.)

    trainer.strategy   what runs                                               checkpoints
    auto               one process (CPU, or one GPU)                           one file
    ddp                DDPStrategy: one process per device, grads all-reduced  one file (rank 0)
    fsdp               FSDP2 (ModelParallelStrategy), fully_shard per block    shards (or one file)

Everything here checks what it can before any process is started, so a bad set-up is a one-line
error instead of a hang. Lightning is imported inside the functions that build its strategies, so that
the checks cost no Lightning import.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptkit import quant
from gptkit.checkpoints import (
    STATE_PREFIX,
    is_sharded_checkpoint,
    remove_checkpoint,
    replace_checkpoint,
    write_checksums,
)
from gptkit.errors import ConfigError, GptkitError
from gptkit.fsio import file_crc32
from gptkit.model.mha import fuse_qkv_names, fuse_qkv_optim_state, fuse_qkv_state
from gptkit.precision import PRECISIONS, Precision, precision, torch_dtype
from gptkit.training.config_checks import check_context_parallel_world, check_mesh_shape
from gptkit.training.elastic import elastic_resume  # noqa: F401  (torch-free: commands/train.py imports it)
from gptkit.training.expert_parallel import ExpertGroup, check_expert_parallel, shard_experts
from gptkit.training.mesh import build_mesh, mesh_dims
from gptkit.training.reshard import load_full, load_sharded
from gptkit.training.slurm import check_slurm_signal
from gptkit.training.tensor_parallel import apply_tensor_parallel, is_tensor_parallel, split_qkv_state

STRATEGIES = ("auto", "ddp", "fsdp")
# "True" in a torchrun worker when the workers' process group uses the rendezvous's own TCPStore
SHARED_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "LSB_JOBID", "NODE_RANK")


# ---- world size and checks -------------------------------------------------------------------------
def accelerator_type(t: Any) -> str:
    """'cuda' or 'cpu': what trainer.accelerator resolves to on this machine."""
    acc = str(t.accelerator)
    if acc in ("gpu", "cuda"):
        return "cuda"
    if acc == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if acc == "cpu":
        return "cpu"
    raise ConfigError(f"trainer.accelerator={acc!r} is not one of auto, cpu, gpu")


def on_cpu(t: Any) -> bool:
    """Whether training runs on CPU (trainer.accelerator=cpu, or auto without a GPU)."""
    return accelerator_type(t) == "cpu"


def devices_per_node(t: Any, accelerator: str | None = None) -> int:
    """Processes per node that trainer.devices asks for (auto: every visible GPU; 1 on CPU). accelerator:
    accelerator_type(t) when the caller has it already."""
    d = t.devices
    if isinstance(d, int) and not isinstance(d, bool) and d >= 1:
        return d
    # Lightning's "all devices", which it refuses on CPU: one spelling here
    if d in (-1, "-1"):
        raise ConfigError("trainer.devices=-1: write trainer.devices=auto (every visible GPU; 1 on CPU)")
    if d == "auto":
        return torch.cuda.device_count() if (accelerator or accelerator_type(t)) == "cuda" else 1
    if isinstance(d, str) and d.isdigit() and int(d) >= 1:
        return int(d)
    # a list of device indices
    if not isinstance(d, (str, int)) and len(d) >= 1:
        return len(d)
    raise ConfigError(f"trainer.devices={d!r} must be a number >= 1, a list of GPU indices, or auto")


def world_size(t: Any) -> int:
    """Processes in the whole job: devices per node x nodes."""
    return devices_per_node(t) * int(t.num_nodes)


def launcher_env() -> dict[str, str]:
    """The environment variables that show an external launcher (torchrun, SLURM, MPI, LSF) started us."""
    return {k: os.environ[k] for k in LAUNCHER_ENV + ("WORLD_SIZE",) if k in os.environ}


def check_distributed(t: Any, checked: Any = None) -> None:
    """One-line errors, before data is prepared or a process is started, for set-ups that would
    otherwise fail late or hang: unknown strategy, more devices than exist, FSDP where it cannot
    run, several nodes without a launcher, a launcher whose world size disagrees with the config, a SLURM job
    whose --signal has no time limit to count back from.
    checked: the trainer's facts (plan.check_trainer) when the caller has them; else derived here."""
    strategy = str(t.strategy)
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"trainer.strategy={strategy!r} is not one of {', '.join(STRATEGIES)} "
            f"(or pick a preset: trainer=ddp, trainer=fsdp)"
        )
    acc = checked.accelerator if checked is not None else accelerator_type(t)
    per_node = checked.devices if checked is not None else devices_per_node(t, acc)
    # trainer.launcher=ray with trainer.ray.address: the workers' devices are the Ray cluster's, not this
    # machine's (Ray waits for them)
    cluster = str(t.get("launcher") or "") == "ray" and bool((t.get("ray") or {}).get("address"))
    if acc == "cuda" and not cluster:
        have = torch.cuda.device_count()
        if have == 0:
            raise GptkitError(
                f"trainer.accelerator={t.accelerator} but no CUDA GPU is visible; "
                f"use trainer.accelerator=cpu (or auto)"
            )
        if per_node > have:
            raise GptkitError(
                f"trainer.devices={t.devices} but this machine has {have} CUDA GPU(s); "
                f"pass trainer.devices={have} or fewer"
            )
    elif not cluster:
        cores = os.cpu_count() or 1
        if per_node > cores:
            raise GptkitError(
                f"trainer.devices={t.devices} CPU processes but this machine has {cores} "
                f"cores; pass trainer.devices={cores} or fewer"
            )
    if strategy == "fsdp":
        _check_fsdp(t, acc, checked.precision if checked is not None else precision(t.precision))
    check_expert_parallel(t, per_node * int(t.num_nodes))
    check_context_parallel_world(int(t.get("context_parallel") or 1), per_node * int(t.num_nodes))
    tp = int(t.get("tensor_parallel") or 1)
    if (per_node * int(t.num_nodes)) % tp:
        world = per_node * int(t.num_nodes)
        larger = "is larger than" if tp > world else "does not divide"
        raise ConfigError(
            f"trainer.tensor_parallel={tp} {larger} the job's {world} process(es) (trainer.devices x "
            f"trainer.num_nodes); pass a divisor of {world}"
        )
    # the degrees together: one mesh (training/mesh.py)
    check_mesh_shape(t, per_node * int(t.num_nodes))
    if (strategy != "auto" or per_node > 1) and not torch.distributed.is_available():
        raise GptkitError("this torch build has no torch.distributed; use trainer=default (one device)")
    nodes = int(t.num_nodes)
    world = per_node * nodes
    env = launcher_env()
    if nodes > 1 and not (env.keys() - {"WORLD_SIZE"}):
        raise GptkitError(
            f"trainer.num_nodes={nodes} needs a launcher that starts the processes on every "
            f"node (torchrun --nnodes={nodes} ..., or sbatch + srun); see the README's "
            "multi-node recipes"
        )
    if "WORLD_SIZE" in env and "TORCHELASTIC_RUN_ID" in env and int(env["WORLD_SIZE"]) != world:
        raise GptkitError(
            f"torchrun started {env['WORLD_SIZE']} processes but trainer.devices x "
            f"trainer.num_nodes = {per_node} x {nodes} = {world}; pass "
            f"trainer.devices=<nproc-per-node> trainer.num_nodes=<nnodes>"
        )
    if (
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0
        and os.environ.get(SHARED_STORE_ENV) == "True"
    ):
        raise GptkitError(
            f"torchrun --max-restarts={os.environ['TORCHELASTIC_MAX_RESTARTS']} with its rendezvous "
            "store shared with the workers: restarted workers can read the previous attempt's addresses "
            "and fail or hang (pytorch#135712); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before "
            "torchrun, or launch with python -m gptkit.torchrun"
        )
    if (
        "SLURM_NTASKS" in env
        and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")
        and int(env["SLURM_NTASKS"]) != world
    ):
        raise GptkitError(
            f"SLURM runs {env['SLURM_NTASKS']} tasks but trainer.devices x trainer.num_nodes = "
            f"{per_node} x {nodes} = {world}; set --ntasks-per-node=<devices> and "
            "--nodes=<num_nodes>"
        )
    # a batch job's --signal=TERM@N needs a time limit to count back from (training/slurm.py)
    check_slurm_signal()


def check_run_name(given: set[str]) -> None:
    """Processes started by torchrun or srun each compose the config: the default run name holds a
    timestamp, which ranks starting a second apart would resolve differently. `given`: the keys the
    command line sets."""
    external = (
        "TORCHELASTIC_RUN_ID" in os.environ
        or int(os.environ.get("SLURM_NTASKS", "1")) > 1
        or int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    )
    if external and not given & {"name", "resume"}:
        raise GptkitError(
            "under torchrun/srun every rank must name the same run folder: pass name=<run "
            "name> (the default name holds a timestamp)"
        )


def _check_fsdp(t: Any, acc: str, p: Precision) -> None:
    try:
        # FSDP2: torch >= 2.6
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError as exc:
        raise GptkitError(
            f"trainer.strategy=fsdp needs FSDP2 (torch >= 2.6, found {torch.__version__}); "
            f"upgrade torch or use trainer=ddp"
        ) from exc
    dist = torch.distributed
    backend_ok = dist.is_nccl_available() if acc == "cuda" else dist.is_gloo_available()
    if not backend_ok:
        backend = "nccl" if acc == "cuda" else "gloo"
        raise GptkitError(
            f"trainer.strategy=fsdp on {acc} needs the {backend} backend, which this torch "
            f"build lacks; use trainer=ddp or another torch build"
        )
    if not p.fsdp:
        supported = ", ".join(p.name for p in PRECISIONS.values() if p.fsdp)
        raise ConfigError(
            f"trainer.strategy=fsdp supports trainer.precision {supported}, "
            f"not {t.precision} (fp16 would need a sharded grad scaler); use bf16-mixed"
        )
    opts = fsdp_options(t)
    for key in ("param_dtype", "reduce_dtype"):
        if opts[key] not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"trainer.fsdp.{key}={opts[key]!r} must be auto, fp32 or bf16")


def fsdp_options(t: Any) -> dict[str, Any]:
    """The trainer.fsdp settings as keyword arguments of gptkit's FSDP2 strategy."""
    defaults = {
        "param_dtype": "auto",
        "reduce_dtype": "fp32",
        "reshard_after_forward": True,
        "sharded_checkpoint": True,
    }
    given = t.get("fsdp") or {}
    return {k: given.get(k, v) for k, v in defaults.items()}


def launcher_plugins(t: Any) -> list:
    """The Lightning plugins trainer.launcher brings: ray's cluster environment (the ranks Ray Train gave this
    worker: gptkit/training/ray_train.py), else none."""
    if str(t.get("launcher") or "") != "ray":
        return []
    from ray.train.lightning import RayLightningEnvironment

    # Ray's Lightning cluster environment: the ranks, world size and node rank from Ray Train's context
    return [RayLightningEnvironment()]


# ---- the Lightning strategy ----------------------------------------------------------------------------
def build_strategy(t: Any):
    """trainer.strategy -> what L.Trainer(strategy=...) takes."""
    strategy = str(t.strategy)
    timeout = timedelta(seconds=float(t.get("process_group_timeout_s") or 1800))
    if strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(timeout=timeout, gradient_as_bucket_view=True)
    if strategy == "fsdp":
        dims = mesh_dims(t, world_size(t))
        return _fsdp2_strategy_class()(fsdp_options(t), str(t.precision), dims, timeout)
    return strategy


@functools.cache
def _fsdp2_strategy_class():
    """Defined on first use so that importing this module does not import Lightning."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    class _FSDP2Strategy(ModelParallelStrategy):
        """ModelParallelStrategy with gptkit's one mesh (training/mesh.py: dp_replicate x dp_shard x cp x tp,
        built once in setup_environment instead of Lightning's [data_parallel, tensor_parallel]); every
        consumer reads its group from `self.mesh`: FSDP2 and TP (`parallelize`), CP (LitGPT.configure_model),
        EP, the sampler and data_ranks (the dp view). Carries the FSDP2 options that LitGPT.configure_model
        applies through `parallelize`. Lightning keeps the loop, the process group and the checkpoints."""

        def __init__(self, options: dict[str, Any], precision_name: str, dims, timeout) -> None:
            super().__init__(
                data_parallel_size=dims.world // dims.tp,
                tensor_parallel_size=dims.tp,
                save_distributed_checkpoint=bool(options["sharded_checkpoint"]),
                timeout=timeout,
            )
            self.fsdp_options = options
            self.fsdp_precision = precision_name
            self.mesh_dims = dims
            # training/mesh.ParallelMesh, once the processes are up
            self.mesh = None
            self.context_parallel, self.expert_parallel = dims.cp, dims.ep

        def setup_environment(self) -> None:
            """Lightning's set-up (the device, the process group), then the one mesh in place of Lightning's
            (its root is what LightningModule.device_mesh gives)."""
            super(ModelParallelStrategy, self).setup_environment()
            self._setup_distributed()
            self.mesh = build_mesh(self.root_device.type, self.mesh_dims)
            self._device_mesh = self.mesh.root
            self.lightning_module._device_mesh = self._device_mesh

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            """The ranks that read distinct items: the mesh's dp view (the cp x tp ranks around a data rank
            read its items)."""
            if self.mesh is not None:
                rank, size = self.mesh.data_ranks()
            else:
                rank, size = self.mesh_dims.coordinates(self.global_rank)["dp"], self.mesh_dims.dp
            return {"num_replicas": size, "rank": rank}

        def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
            """A sharded checkpoint is written to a temporary folder beside the target; every rank computes
            the CRC-32 of the shards it wrote, rank 0 writes them all to checksums.json and renames the
            folder once every rank is done: a kill during the save keeps the old one."""
            if not self._save_distributed_checkpoint:
                return super().save_checkpoint(checkpoint, filepath, storage_options)

            path = Path(self.broadcast(str(filepath)))
            tmp = path.with_name(f".{path.name}.tmp")
            if self.global_rank == 0:
                remove_checkpoint(tmp)
            self.barrier()
            super().save_checkpoint(checkpoint, tmp, storage_options)
            mine = {f.name: file_crc32(f) for f in tmp.glob(f"__{self.global_rank}_*.distcp")}
            every: list[Any] = [None] * self.world_size
            # also the barrier: every shard is written
            dist.all_gather_object(every, mine)
            if self.global_rank == 0:
                write_checksums(tmp, {k: v for part in every for k, v in part.items()})
                replace_checkpoint(tmp, path)
            self.barrier()

        def lightning_module_state_dict(self) -> dict[str, Any]:
            """One-file checkpoints (sharded_checkpoint=false) of a fine-tune whose checkpoints hold only what
            trains (lora, qlora): only those tensors are gathered to rank 0; the frozen weights stay in their
            shards (gathering them all to drop them wasted the collective, and an NF4 weight's left torch's
            functional collectives unwaited)."""
            finetune = getattr(self.lightning_module, "finetune", None)
            if self._save_distributed_checkpoint:
                return super().lightning_module_state_dict()
            if finetune is None or finetune.saves_every_weight:
                # one file is in the one-process layout: a tensor-parallel run's q, k, v fused (reshard.py)
                return fuse_qkv_state(super().lightning_module_state_dict())
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            from torch.distributed.tensor import DTensor

            local = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False))
            kept = finetune.checkpoint_state(local, STATE_PREFIX)
            # collective: every rank gathers every kept tensor, in the same order
            full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in kept.items()}
            return {k: v.cpu() for k, v in full.items()} if self.global_rank == 0 else {}

        def optimizer_state(self, optimizer) -> dict[str, Any]:
            """One-file checkpoints: the optimizer state in torch.optim's own format, each parameter keyed by
            its index across the optimizer's param groups (what reshard.load_full reads), gathered to rank 0.
            Lightning's re-keying counts module.named_parameters(), frozen ones included, which neither a
            LoRA run's optimizer (the adapters only: a resume failed with an IndexError) nor gptkit's grouped
            order matches."""
            if self._save_distributed_checkpoint:
                return super().optimizer_state(optimizer)
            from lightning.pytorch.core.optimizer import LightningOptimizer
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            if isinstance(optimizer, LightningOptimizer):
                optimizer = optimizer._optimizer
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            # collective
            osd = get_optimizer_state_dict(self.model, optimizer, options=options)
            if self.global_rank != 0:
                return {}
            names = {id(p): n for n, p in self.model.named_parameters()}
            # the one-process layout: a tensor-parallel run's q, k, v state fused, one index (reshard.py)
            osd = fuse_qkv_optim_state(osd)
            order = fuse_qkv_names([names[id(p)] for g in optimizer.param_groups for p in g["params"]])
            index = {n: i for i, n in enumerate(order)}
            return {
                "state": {index[n]: s for n, s in osd["state"].items()},
                "param_groups": [
                    dict(g, params=[index[n] for n in g["params"]]) for g in osd["param_groups"]
                ],
            }

        def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
            """Like ModelParallelStrategy's, but the shard index and non-tensor values are read without
            unpickling code (see _SafeUnpickler); any world size reads any other's shards."""
            path = Path(self.broadcast(str(checkpoint_path)))
            # one file: a one-process or DDP run's, or consolidated
            if not is_sharded_checkpoint(path):
                return load_full(self.lightning_module, self.optimizers, path)
            # any mesh's shards (training/reshard.py)
            return load_sharded(self.lightning_module, self.optimizers, path)

    return _FSDP2Strategy


def broadcast_weights(model, full_state: dict | None, device) -> None:
    """After fully_shard: every rank's shards take rank 0's weights (full_state on rank 0, None elsewhere).
    A rank whose model was built on the meta device first allocates its shards on `device` (RoPE tables are
    recomputed then). Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if full_state is not None and is_tensor_parallel(model):
        # the fused q/k/v projection is three parameters there (training/tensor_parallel.py)
        full_state = split_qkv_state(full_state, model)
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model.to_empty(device=device)
    set_model_state_dict(
        model, full_state or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


def parallelize(model, strategy) -> bool:
    """Shard `model` (the GPT) with FSDP2 when `strategy` is the fsdp strategy (its mesh built): one
    fully_shard unit per transformer block, then the root (embeddings, final norm, head: tied weights stay in
    one unit).
    Returns True when it sharded. Idempotent."""
    options = getattr(strategy, "fsdp_options", None)
    if options is None or getattr(model, "_gptkit_sharded", False):
        return False
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param = options["param_dtype"]
    if param == "auto":
        # bf16 for bf16-mixed and bf16-true, else fp32
        param = precision(strategy.fsdp_precision).compute
    policy = MixedPrecisionPolicy(
        param_dtype=torch_dtype(param, "trainer.fsdp.param_dtype"),
        reduce_dtype=torch_dtype(options["reduce_dtype"], "trainer.fsdp.reduce_dtype"),
    )
    # the one mesh (training/mesh.py): FSDP2 over dp_shard x cp (HSDP: the 2-D (dp_replicate, dp_shard_cp))
    mesh = strategy.mesh.fsdp
    reshard = bool(options["reshard_after_forward"])
    ep = strategy.mesh.dims.ep
    # trainer.tensor_parallel: heads, MLP columns and the vocabulary over the tensor-parallel ranks first (an
    # MoE layer on each rank's slice of the sequence, its experts left to expert parallelism when ep > 1)
    if strategy.mesh["tp"].size() > 1:
        apply_tensor_parallel(model, strategy.mesh["tp"], ep)
    # trainer.expert_parallel: the experts split over groups of data ranks, the rest FSDP2's
    experts = None
    if ep > 1 and model.cfg.moe is not None:
        compute = policy.param_dtype if policy.param_dtype != torch.float32 else None
        experts = shard_experts(model, ExpertGroup.of(strategy.mesh, compute))
    # torch 2.13's FSDP2 runs a world of one through a path that takes one all-gather input per parameter,
    # which torchao's NF4 weights (finetune=qlora: three each) break; there they stay whole, outside FSDP
    nf4 = {p for p in model.parameters() if quant.is_nf4(p)} if mesh.size() == 1 else set()
    ignored = (experts or set()) | nf4 or None
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, ignored_params=ignored)
    model._gptkit_sharded = True
    return True


# ---- the gradient norm -----------------------------------------------------------------------------------
def clip_gradients(params: list, max_norm: float | None) -> torch.Tensor:
    """The total norm of the parameters' gradients (a plain tensor on the device: FSDP2's sharded ones
    reduced over the ranks, with no host sync) and, with max_norm, the gradients scaled so that it is at most
    max_norm, as torch.nn.utils.clip_grad_norm_. Gradients on several device meshes (FSDP2's and expert
    parallelism's, which torch's own cannot stack) are normed per mesh, then together."""
    grads = [p.grad for p in params]
    meshes: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        meshes.setdefault(getattr(g, "device_mesh", None), []).append(g)
    if len(meshes) == 1:
        if max_norm is None:
            norm = torch.nn.utils.get_total_norm(grads)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    parts = [torch.nn.utils.get_total_norm(group) for group in meshes.values()]
    norm = torch.linalg.vector_norm(
        torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in parts])
    )
    if max_norm is not None:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            torch._foreach_mul_([g.to_local() if hasattr(g, "to_local") else g for g in grads], scale)
    return norm


# ---- failing fast -----------------------------------------------------------------------------------------
def fail_fast_callback():
    """A callback that, when this process fails, kills the ranks Lightning started, so that they do not
    wait in a collective until the timeout. (A failing child is caught by Lightning's own observer,
    which kills the whole job; torchrun and `srun --kill-on-bad-exit=1` do the same.)"""
    from lightning.pytorch.callbacks import Callback

    class FailFast(Callback):
        def on_exception(self, trainer, pl_module, exception) -> None:
            launcher = trainer.strategy.launcher
            if isinstance(exception, KeyboardInterrupt) or launcher is None:
                return
            procs = getattr(launcher, "procs", [])
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)

    return FailFast()


# ---- preflight -----------------------------------------------------------------------------------------
def probe_collective(device: str) -> dict[str, Any]:
    """Inside an initialised process group: one all-reduce of each rank's rank number, timed."""
    x = torch.tensor([float(dist.get_rank())], device=device)  # [1]
    t0 = time.perf_counter()
    dist.all_reduce(x)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    world = dist.get_world_size()
    return {
        "sum": float(x.item()),
        "expected": world * (world - 1) / 2,
        "seconds": dt,
        "backend": dist.get_backend(),
    }


# what the bandwidth probe all-reduces: 16 MiB of fp32, BANDWIDTH_ITERS times after one warm-up
BANDWIDTH_BYTES = 16 * 2**20
BANDWIDTH_ITERS = 5


def probe_bandwidth(
    device: str, nbytes: int = BANDWIDTH_BYTES, iters: int = BANDWIDTH_ITERS
) -> dict[str, Any]:
    """Inside an initialised process group: `iters` all-reduces of `nbytes` of fp32 (after one warm-up),
    timed on this rank. busbw is nccl-tests' bus bandwidth, size / time x 2(n-1)/n: what each link between
    neighbouring ranks carries in a ring all-reduce, comparable across world sizes."""
    x = torch.ones(nbytes // 4, device=device)
    dist.all_reduce(x)
    dist.barrier()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    per_op = (time.perf_counter() - t0) / iters
    world = dist.get_world_size()
    return {"bw_bytes": nbytes, "bw_seconds": per_op, "busbw": nbytes / per_op * 2 * (world - 1) / world}
