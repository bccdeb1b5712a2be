"""One device mesh for every parallelism of a trainer=fsdp run, built once by the strategy
(training/distributed.py); FSDP2, tensor, context and expert parallelism and the data loading each read
their process group from it. (torchtitan's ParallelDims is the model; the code is ours.)

    dims        dp_replicate x dp_shard x cp x tp = the job's processes, outer to inner: a tensor-parallel
                group is tp consecutive ranks, a context-parallel group the cp x tp ranks around it
                    dp_replicate  trainer.data_parallel_replicate (HSDP: whole copies of the shards)
                    dp_shard      what is left: world / (dp_replicate x cp x tp)
                    cp            trainer.context_parallel (each sequence over cp ranks)
                    tp            trainer.tensor_parallel (each layer's heads and columns over tp ranks)
    views       (flattened, kept here: torch deprecates slicing flattened names from the root)
        dp            dp_replicate x dp_shard: the ranks that read distinct batches (the sampler, data_ranks)
        dp_shard_cp   dp_shard x cp: what FSDP2 shards each weight over (cp ranks hold different tokens of
                      the same rows: their gradients add up like data ranks')
        fsdp          dp_shard_cp, or with dp_replicate > 1 the 2-D (dp_replicate, dp_shard_cp): HSDP,
                      shards within a replica, gradients reduce-scattered there then all-reduced across
        dp_cp         dp_replicate x dp_shard x cp: every rank of one tp coordinate (a gradient's mean)
        ep            trainer.expert_parallel: the innermost ep ranks of dp_shard x cp (carved out of the
                      data ranks as torchtitan does): each holds E / ep experts of every mixture
        ep_replicas   dp_replicate x (dp_shard x cp / ep) x tp: the ranks that hold the same experts

E.g. 8 processes, trainer.expert_parallel=2 trainer.tensor_parallel=2: dp_shard 4, tp groups {0,1} {2,3}
..., the dense weights sharded over dp_shard_cp {0,2,4,6} (and {1,3,5,7}), expert groups {0,2} {4,6} ...,
expert replicas {0,1,4,5} .... A size-1 dimension is kept (every name exists; its group holds this rank
alone); ep and ep_replicas exist with trainer.expert_parallel > 1 only.

MeshDims is torch-free (the plan and the checks read it); build_mesh makes the DeviceMesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gptkit.training.config_checks import check_mesh_shape

# the mesh's dimensions, outer to inner
DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class MeshDims:
    """The degrees of one mesh over `world` processes (check_mesh_shape has checked that they factor)."""

    world: int
    dp_replicate: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def dp_shard(self) -> int:
        return self.world // (self.dp_replicate * self.cp * self.tp)

    @property
    def dp(self) -> int:
        """The data ranks: ranks that read distinct batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """The ranks FSDP2 shards a weight over (within one replica)."""
        return self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """rank's place on each dimension (row-major over DIMS) and on the views dp and ep."""
        coords, rest = {}, rank
        for name, size in reversed(list(zip(DIMS, self.shape))):
            coords[name] = rest % size
            rest //= size
        coords["dp"] = coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]
        coords["ep"] = (coords["dp_shard"] * self.cp + coords["cp"]) % self.ep
        return coords

    def describe(self) -> str:
        """One line: the degrees by name (size-1 ones left out), e.g. "dp_shard 2 x cp 2 (4 ranks)"."""
        parts = [f"{n} {s}" for n, s in zip(DIMS, self.shape) if s > 1] or ["dp_shard 1"]
        ep = f", ep {self.ep} of dp_shard x cp" if self.ep > 1 else ""
        return f"{' x '.join(parts)}{ep} ({self.world} rank(s))"


def mesh_dims(t: Any, world: int) -> MeshDims:
    """The trainer config's mesh over `world` processes (one-line ConfigError when it does not factor)."""
    r, cp, tp, ep = check_mesh_shape(t, world)
    return MeshDims(world=world, dp_replicate=r, cp=cp, tp=tp, ep=ep)


class ParallelMesh:
    """The DeviceMesh (dims DIMS) and its views by name: mesh["tp"], mesh["dp"], mesh.fsdp ..."""

    def __init__(self, dims: MeshDims, root, views: dict[str, Any]) -> None:
        self.dims, self.root, self.views = dims, root, views

    def __getitem__(self, name: str):
        """The 1-D DeviceMesh of a dimension (DIMS) or a view (dp, dp_shard_cp, dp_cp, ep, ep_replicas)."""
        return self.views[name]

    @property
    def fsdp(self):
        """What fully_shard takes: dp_shard_cp, or (dp_replicate, dp_shard_cp) for HSDP."""
        return self.views["fsdp"]

    def data_ranks(self) -> tuple[int, int]:
        """(this rank's place, how many) among the ranks that read distinct batches: the dp view."""
        dp = self.views["dp"]
        return dp.get_local_rank(), dp.size()


def build_mesh(device_type: str, dims: MeshDims) -> ParallelMesh:
    """One init_device_mesh over the job (collective: every rank calls it, the process group up) and its
    views. Process groups: one per dimension and per view (a dimension as large as the world reuses the
    default group)."""
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh(device_type, dims.shape, mesh_dim_names=DIMS)
    views = {name: root[name] for name in DIMS}
    views["dp"] = root["dp_replicate", "dp_shard"]._flatten("dp")
    views["dp_shard_cp"] = root["dp_shard", "cp"]._flatten("dp_shard_cp")
    views["dp_cp"] = root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    if dims.dp_replicate > 1:
        # HSDP: the same ranks as (dp_replicate, dp_shard_cp), as one 2-D mesh
        shape = (dims.dp_replicate, dims.dp_shard_cp)
        views["fsdp"] = views["dp_cp"]._unflatten(0, shape, ("hsdp_replicate", "hsdp_shard"))
    else:
        views["fsdp"] = views["dp_shard_cp"]
    if dims.ep > 1:
        # expert groups: dp_shard x cp split into (dp_shard x cp / ep, ep), ep innermost, in every replica and
        # tp coordinate; the replicas span tp too (an MoE layer routes each tp rank's own tokens:
        # training/moe_tensor_parallel.py)
        shape = (dims.dp_replicate, dims.dp_shard_cp // dims.ep, dims.ep, dims.tp)
        every = root["dp_replicate", "dp_shard", "cp", "tp"]._flatten("ep_world")
        sparse = every._unflatten(0, shape, ("ep_outer", "ep_shard", "ep", "ep_tp"))
        views["ep"] = sparse["ep"]
        views["ep_replicas"] = sparse["ep_outer", "ep_shard", "ep_tp"]._flatten("ep_replicas")
    mesh = ParallelMesh(dims, root, views)
    _check_sizes(mesh)
    return mesh


def _check_sizes(mesh: ParallelMesh) -> None:
    d = mesh.dims
    want = dict(zip(DIMS, d.shape), dp=d.dp, dp_shard_cp=d.dp_shard_cp, dp_cp=d.dp_cp)
    if d.ep > 1:
        want.update(ep=d.ep, ep_replicas=d.dp_cp // d.ep * d.tp)
    for name, size in want.items():
        if mesh[name].size() != size:
            raise AssertionError(f"mesh view {name}: {mesh[name].size()} ranks, expected {size}")
