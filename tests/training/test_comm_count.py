"""The bytes each rank sends per training micro-step, counted on gloo processes
(comm_count.py), against gptkit/parallel_plan.communication's formulas (docs/parallelism.md),
kind by kind: tensor parallel, context parallel (ring), FSDP, DDP and expert parallel, with and without
activation checkpointing.
"""

from pathlib import Path

import comm_count_distributed as w
import pytest

from gptkit.model import GPT, ModelConfig


def check(case: str, ranks: list[dict]) -> None:
    """Every rank's bytes per kind equal the formula's (DDP: plus the buffers it broadcasts every forward)."""
    want = w.planned(case)
    if CASES_DDP.get(case):
        model = GPT(ModelConfig.from_dict(w.CASES[case][0]))
        want["dp"] += sum(b.numel() * b.element_size() for b in model.buffers())
    for rank, got in enumerate(ranks):
        assert set(got["step"]) == set(want), (case, rank, got["step"], want)
        for kind, value in want.items():
            assert got["step"][kind] == value, (case, rank, kind, got["step"][kind], value)
        # the step after the backward: scalars only (the loss tokens, the gradient norm)
        assert sum(got["optimizer"].values()) < 256, (case, rank, got["optimizer"])


CASES_DDP = {c: v[5] == "ddp" for c, v in w.CASES.items()}


@pytest.mark.long
def test_bytes_sent_per_kind_equal_the_plans_formulas_on_two_ranks(tmp_path: Path):
    """tp 2, cp 2 (ring), FSDP over 2, DDP over 2, ep 2 (a mixture whose every token visits every expert:
    an even all-to-all), tp 2 / cp 2 under full and selective checkpointing, tp 2 with replicated K/V, and
    tp / cp / ep in bf16-mixed: one launch of 2 processes, every case's bytes per kind exactly the
    formula's."""
    cases = [c for c, v in w.CASES.items() if v[1] == 2]
    got = w.launch(cases, 2, tmp_path)
    for case in cases:
        check(case, got[case])


@pytest.mark.long
def test_bytes_sent_on_meshes_of_four(tmp_path: Path):
    """dp 2 x tp 2 on 4 processes: TP's collectives on [b, T, d] and FSDP's over the 2 data ranks of what a
    tensor-parallel rank holds (the norms whole); cp 2 x tp 2: TP's on [b, T/2, d], the ring on each tensor-
    parallel rank's heads, FSDP over the ring's 2 ranks. One launch, the cases one after the other."""
    cases = ["dp2_tp2", "cp2_tp2"]
    got = w.launch(cases, 4, tmp_path)
    for case in cases:
        check(case, got[case])


def test_counter_follows_its_convention_on_two_ranks(tmp_path: Path):
    """Each collective's bytes sent (the module docstring's convention) on 2 gloo ranks: all-gather,
    reduce-scatter, all-reduce, an uneven all-to-all, send and recv, a DTensor's scatter from rank 0 and its
    redistribution (a functional collective), all under the kind of their group."""
    got = w.launch(["convention"], 2, tmp_path)["convention"]
    for rank, r in enumerate(got):
        n = 4 * 6 * 4  # a [4, 6] fp32 tensor
        want = {
            "all_gather": n,  # its input, passed on once
            "reduce_scatter": n // 2,
            "all_reduce": n,  # 2 (k-1)/k N
            "all_to_all": [3, 1][rank] * 6 * 4,  # rank 0 sends 3 of its 4 rows, rank 1 one of its 4
            # rank 0 sends, rank 1 receives (0 sent)
            ["send", "recv"][rank]: [n, 0][rank],
            # distribute_tensor: rank 0 scatters [4, 6] (sends the other rank's half)
            "scatter": [n // 2, 0][rank],
            "redistribute": n // 2,  # Shard(0) -> Replicate: an all-gather of [2, 6] shards
        }
        assert r["families"] == want, (rank, r["families"])
        assert set(r["step"]) == {"world"}, r["step"]
