"""The one device mesh (gptkit/training/mesh.py): its arithmetic against torch's row-major layout of the
ranks, the views of a one-process mesh, and the refusals of a mesh that does not factor (one line, exit 2,
torch not imported). The mesh on 8 gloo processes and `gptkit train` on 4 ((dp 2, cp 2), (dp 2, tp 2), HSDP)
against one process: .ci/mesh."""

import pytest
import torch
from conftest import REPO, refused_before_torch
from omegaconf import OmegaConf

from gptkit.errors import ConfigError
from gptkit.training.mesh import DIMS, MeshDims


@pytest.mark.parametrize(
    "world, r, cp, tp, ep",
    [(1, 1, 1, 1, 1), (4, 1, 2, 1, 1), (4, 1, 1, 2, 1), (4, 2, 1, 1, 1), (8, 1, 1, 2, 2), (8, 2, 2, 1, 2)],
)
def test_the_coordinates_are_torchs_row_major_layout(world, r, cp, tp, ep):
    """Rank q sits at ranks.reshape(dp_replicate, dp_shard, cp, tp)'s index of q (tp innermost: consecutive
    ranks); dp counts the data ranks (replicate x shard), ep the innermost ep of dp_shard x cp."""
    dims = MeshDims(world, r, cp, tp, ep)
    assert dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp == world
    grid = torch.arange(world).reshape(dims.shape)
    for q in range(world):
        c = dims.coordinates(q)
        assert grid[tuple(c[n] for n in DIMS)] == q
        assert c["dp"] == c["dp_replicate"] * dims.dp_shard + c["dp_shard"] < dims.dp
        assert c["ep"] == (c["dp_shard"] * cp + c["cp"]) % ep


def test_dp2_ep2_tp2_on_8_ranks_shards_the_dense_weights_over_4_and_the_experts_over_2():
    """The issue's (dp 2, ep 2, tp 2): ep is carved out of the data ranks, so dp_shard is 4 (the dense weights
    over 4 ranks), an expert group is 2 ranks of one tp coordinate, its replicas every other rank of its ep
    coordinate, both tp coordinates' (each routes its own tokens: training/moe_tensor_parallel.py)."""
    dims = MeshDims(8, tp=2, ep=2)
    assert (dims.dp_shard, dims.dp_shard_cp, dims.dp, dims.dp_cp) == (4, 4, 4, 4)
    every = [dims.coordinates(q) for q in range(8)]

    def same(q: int, *keys: str) -> list[int]:
        return [p for p, c in enumerate(every) if all(c[k] == every[q][k] for k in keys)]

    assert same(0, "tp") == [0, 2, 4, 6] and same(1, "dp") == [0, 1]
    # rank 0's expert group: same tp, same block of ep data ranks; its replicas: same ep coordinate
    block = [(c["dp_shard"] * dims.cp + c["cp"]) // 2 for c in every]
    assert [p for p in same(0, "tp") if block[p] == block[0]] == [0, 2]
    assert same(0, "ep") == [0, 1, 4, 5]
    assert dims.describe() == "dp_shard 4 x tp 2, ep 2 of dp_shard x cp (8 rank(s))"


def test_a_one_process_mesh_has_every_view():
    """build_mesh on a world of one: every dimension and view exists with one rank (the fsdp strategy on one
    device reads the same names)."""
    import torch.distributed as dist

    from gptkit.training.mesh import build_mesh

    fresh = not dist.is_initialized()
    if fresh:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = build_mesh("cpu", MeshDims(1))
        for name in (*DIMS, "dp", "dp_shard_cp", "dp_cp"):
            assert mesh[name].size() == 1 and mesh[name].get_local_rank() == 0
        assert mesh.fsdp is mesh["dp_shard_cp"] and mesh.data_ranks() == (0, 1)
        assert mesh.root.mesh_dim_names == DIMS
    finally:
        if fresh:
            dist.destroy_process_group()


def test_a_mesh_that_does_not_factor_is_refused_in_one_line_before_torch():
    fsdp = ("trainer=fsdp",)
    refused = {
        ("trainer.data_parallel_replicate=0",): "trainer.data_parallel_replicate=0 must be an integer >= 1",
        ("trainer.data_parallel_replicate=2", "trainer.devices=2"): "HSDP): it needs trainer=fsdp",
        (*fsdp, "trainer.devices=2", "trainer.data_parallel_replicate=4"): (
            "trainer.data_parallel_replicate=4 is larger than the job's 2 process(es) (trainer.devices x "
            "trainer.num_nodes); the mesh does not factor: pass a divisor of 2"
        ),
        (*fsdp, "trainer.devices=6", "trainer.context_parallel=2", "trainer.data_parallel_replicate=2"): (
            "trainer.data_parallel_replicate=2 does not divide the 3 rank(s) left of the job's 6 by "
            "trainer.context_parallel=2"
        ),
        (*fsdp, "trainer.devices=4", "trainer.tensor_parallel=2", "trainer.data_parallel_replicate=4"): (
            "trainer.data_parallel_replicate=4 is larger than the 2 rank(s) left of the job's 4 by "
            "trainer.tensor_parallel=2"
        ),
        (*fsdp, "trainer.devices=4", "trainer.data_parallel_replicate=2", "trainer.expert_parallel=4"): (
            "trainer.expert_parallel=4 is larger than the dp_shard x cp = 2 x 1 = 2 rank(s)"
        ),
    }
    refused_before_torch(refused)


def test_hsdp_larger_than_the_devices_found_is_refused():
    """trainer.devices=auto (1 on the CPU): the world is known once torch is: checked with the devices."""
    from gptkit.training.distributed import check_distributed

    t = OmegaConf.merge(*(OmegaConf.load(REPO / f"conf/trainer/{n}.yaml") for n in ("default", "fsdp")))
    t.merge_with({"accelerator": "cpu", "devices": "auto", "data_parallel_replicate": 2})
    with pytest.raises(ConfigError) as e:
        check_distributed(t)
    assert "data_parallel_replicate=2 is larger than the job's 1 process" in str(e.value)
    assert "\n" not in str(e.value)
