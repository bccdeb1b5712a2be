"""trainer.context_parallel (gptkit/training/context_parallel.py): the zig-zag split, and the ring's forward
(blocks merged by their log-sum-exp) and backward run for k simulated ranks in one process against one
process's attention, fp32, with packed documents and sliding windows crossing the chunk boundaries. The real
ring (k gloo processes, the model's loss per token and per document, gradients, T up to 16k):
.ci/context_parallel.py. The config's refusals: one line, exit 2, torch not imported."""

import pytest
import torch
from conftest import REPO, refused_before_torch, rows_by_step, run_group, tiny_run

from gptkit.errors import ConfigError
from gptkit.model.attention import eager_attention
from gptkit.model.documents import Documents
from gptkit.training import context_parallel as cp


def test_zigzag_split_balances_causal_work_and_unsplits():
    for k in (1, 2, 3, 4):
        T = 8 * k
        x = torch.arange(T)[None, :, None]  # [1, T, 1]
        parts = [cp.split(x, k, r) for r in range(k)]
        c = T // (2 * k)
        for r, part in enumerate(parts):
            # chunks r and 2k-1-r
            assert part[0, :, 0].tolist() == [
                *range(r * c, r * c + c),
                *range((2 * k - 1 - r) * c, (2 * k - r) * c),
            ]
        assert torch.equal(cp.unsplit(parts), x)
        # every rank computes the same number of causal chunk pairs, 2k + 1 (no window)
        for r in range(k):
            shard = cp.shard_of(T, k, r, None, None)
            pairs = [p for o in range(k) for p in cp._pairs(shard, cp.chunks_of(o, k), None)]
            assert len(pairs) == 2 * k + 1


# documents of 5, 13, 7, ... tokens: their boundaries fall inside chunks (T = 48: chunks of 6, 8, 12)
DOC_LENGTHS = [5, 13, 7, 1, 11, 11]


@pytest.mark.parametrize(
    "k, docs, window, backend",
    [(2, True, 13, "eager"), (3, True, None, "sdpa"), (4, False, 9, "sdpa"), (4, True, 7, "eager")],
)
def test_ring_merged_by_lse_equals_one_process_attention(k, docs, window, backend):
    torch.manual_seed(k)
    B, H, Hkv, T, D = 2, 4, 2, 48, 8
    q = torch.randn(B, H, T, D, requires_grad=True)
    kk = torch.randn(B, Hkv, T, D, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, requires_grad=True)
    d = None
    if docs:
        ids = torch.repeat_interleave(torch.arange(len(DOC_LENGTHS)), torch.tensor(DOC_LENGTHS))
        d = Documents(torch.stack([ids, ids.flip(0)]))
    ref, _ = eager_attention(q, kk, v, docs=d, window=window)
    out, lse = cp.simulate(q, kk, v, k, None if d is None else d.start, window, backend=backend)
    assert (out - ref).abs().max() < 1e-6
    # the merged log-sum-exp is the whole row's
    keep = (d.mask() if d is not None else torch.ones(T, T, dtype=torch.bool).tril()) & cp._keep(
        torch.arange(T), torch.arange(T), None, window
    )
    scores = (q @ kk.repeat_interleave(2, 1).transpose(-2, -1)) * D**-0.5
    assert (lse - torch.logsumexp(scores.masked_fill(~keep, float("-inf")), -1)).abs().max() < 1e-5
    g = torch.randn_like(ref)
    want = torch.autograd.grad((ref * g).sum(), (q, kk, v))
    got = torch.autograd.grad((out * g).sum(), (q, kk, v))
    assert max((a - b).abs().max().item() for a, b in zip(want, got)) < 1e-5


def test_a_float64_model_runs_the_ring_in_float64():
    """The ring's scores, log-sum-exps and accumulators are fp32, fp64 for a fp64 model (the exact check of
    .ci/context_tensor_parallel.py runs fp64): the same as fp64 attention to 1e-12."""
    torch.manual_seed(0)
    B, H, Hkv, T, D = 1, 4, 2, 24, 8
    q, kk, v = (torch.randn(B, h, T, D, dtype=torch.float64, requires_grad=True) for h in (H, Hkv, Hkv))
    out, lse = cp.simulate(q, kk, v, 3, window=7, backend="eager")
    assert out.dtype == lse.dtype == torch.float64
    keep = cp._keep(torch.arange(T), torch.arange(T), None, 7)
    s = ((q @ kk.repeat_interleave(2, 1).transpose(-2, -1)) * D**-0.5).masked_fill(~keep, float("-inf"))
    ref = torch.softmax(s, -1) @ v.repeat_interleave(2, 1)
    assert (out - ref).abs().max() < 1e-12 and (lse - torch.logsumexp(s, -1)).abs().max() < 1e-12
    g = torch.randn_like(ref)
    want = torch.autograd.grad((ref * g).sum(), (q, kk, v))
    got = torch.autograd.grad((out * g).sum(), (q, kk, v))
    assert all(x.dtype == torch.float64 for x in got)
    assert max((a - b).abs().max().item() for a, b in zip(want, got)) < 1e-12


def test_a_context_and_tensor_parallel_block_of_ranks_reads_one_batch():
    """trainer.context_parallel=2 x tensor_parallel=2 on 8 ranks (mesh [dp 2, cp 2, tp 2], tp innermost):
    ranks 0-3 read data rank 0's batch, 4-7 data rank 1's (the fsdp strategy's sampler ranks)."""
    from types import SimpleNamespace

    from gptkit.training.distributed import _fsdp2_strategy_class
    from gptkit.training.mesh import MeshDims

    kwargs = _fsdp2_strategy_class().distributed_sampler_kwargs.fget
    dims = MeshDims(world=8, cp=2, tp=2)
    got = [kwargs(SimpleNamespace(mesh=None, mesh_dims=dims, global_rank=r)) for r in range(8)]
    assert got == [{"num_replicas": 2, "rank": r // 4} for r in range(8)]


def test_context_parallel_settings_are_refused_in_one_line_before_torch():
    fsdp = ("trainer=fsdp", "trainer.devices=2")
    refused = {
        ("trainer.context_parallel=0",): "trainer.context_parallel=0 must be an integer >= 1",
        ("trainer.context_parallel=2", "trainer.devices=2"): "it needs trainer=fsdp",
        (
            "trainer=fsdp",
            "trainer.devices=3",
            "trainer.context_parallel=2",
        ): "must divide the job's 3 process",
        (
            "trainer=fsdp",
            "trainer.devices=1",
            "trainer.context_parallel=4",
        ): "larger than the job's 1 process",
        (*fsdp, "trainer.context_parallel=2", "trainer.seq_len=30"): "divisible by 2 x 2 = 4",
        (*fsdp, "trainer.context_parallel=2", "model.attention=triton"): "pass model.attention=sdpa or eager",
        (
            *fsdp,
            "trainer.context_parallel=2",
            "model=gemma3-tiny",
            "model.attn_softcap=30.0",
        ): "does not support model.attn_softcap",
        (*fsdp, "trainer.context_parallel=2", "trainer.compile=blocks"): "pass trainer.compile=null",
        (*fsdp, "trainer.context_parallel=2", "model=moe-tiny"): "does not support model.moe yet",
        (*fsdp, "trainer.context_parallel=2", "objective=dpo"): "objective=lm only",
        (
            "trainer=fsdp",
            "trainer.devices=6",
            "trainer.context_parallel=2",
            "trainer.tensor_parallel=2",
        ): "trainer.context_parallel=2 does not divide the 3 rank(s) left of the job's 6",
    }
    refused_before_torch(refused)


def test_a_mesh_larger_than_the_devices_found_is_refused():
    """trainer.devices=auto (1 on the CPU): the world is known once torch is: checked with the devices."""
    from omegaconf import OmegaConf

    from gptkit.training.distributed import check_distributed

    t = OmegaConf.merge(*(OmegaConf.load(REPO / f"conf/trainer/{n}.yaml") for n in ("default", "fsdp")))
    t.merge_with({"accelerator": "cpu", "devices": "auto", "context_parallel": 4})
    with pytest.raises(ConfigError) as e:
        check_distributed(t)
    assert "larger than the job's 1 process" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.long
def test_gptkit_train_with_context_parallel_2_follows_one_process(corpus, tmp_path):
    """`gptkit train trainer=fsdp trainer.devices=2 trainer.context_parallel=2` (2 gloo processes, each
    holding half of every sequence, attention as a ring) logs the losses and gradient norms of one process,
    with packed documents, positions restarting in each, and a sliding window crossing the chunks (fp32);
    also with activation checkpointing (the recomputed blocks must run the ring again in the backward)."""
    args = tiny_run(
        corpus,
        tmp_path,
        None,
        "model.n_layers=2",
        "model.position=rope",
        "model.attention=eager",
        "model.dropout=0.0",
        "model.position_reset=true",
        "model.sliding_window=12",
        "model.layer_types=[local,global]",
        "tokenizer.eos_token='<|eos|>'",
        "data.pack=documents",
        "trainer.max_steps=4",
        "trainer.val_every=2",
        "trainer.checkpoint_every=4",
        "trainer.precision=32-true",
        "trainer.accelerator=cpu",
    )
    runs = {}
    for name, extra in (
        ("one", []),
        ("cp", ["trainer=fsdp", "trainer.devices=2", "trainer.context_parallel=2"]),
        (
            "cp_ckpt",
            [
                "trainer=fsdp",
                "trainer.devices=2",
                "trainer.context_parallel=2",
                "trainer.activation_checkpointing=full",
            ],
        ),
    ):
        r = run_group("-m", "gptkit", "train", *args, f"name={name}", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = rows_by_step(tmp_path / name)
    for name in ("cp", "cp_ckpt"):
        assert sorted(runs[name]) == sorted(runs["one"]) == [1, 2, 3, 4]
        for step, want in runs["one"].items():
            for key in ("train/loss", "train/grad_norm", "val/loss", "perf/tokens"):
                if want.get(key):
                    assert abs(float(runs[name][step][key]) - float(want[key])) < 1e-5, (name, step, key)
