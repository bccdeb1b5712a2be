"""The stateless sampler and the DataModule: exact resume, disjoint ranks, fixed validation windows."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gptkit.data import TokenDataModule, WindowSampler, prepare
from gptkit.errors import GptkitError

SEQ = 16


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sampler")
    rng = np.random.default_rng(0)
    (tmp / "a.txt").write_text("".join(chr(c) for c in rng.integers(97, 123, size=20_000)))
    return prepare(
        {"kind": "files", "paths": [str(tmp / "a.txt")]},
        {"kind": "byte"},
        cache_dir=tmp / "cache",
        progress=False,
    )


def starts_of(x, tokens):
    """Recover each row's window start (rows of random letters are unique in 20k tokens)."""
    t = torch.from_numpy(np.asarray(tokens).astype(np.int64))
    out = []
    for row in x:
        hits = [s for s in range(len(t) - SEQ) if torch.equal(t[s : s + SEQ], row)]
        assert len(hits) == 1
        out.append(hits[0])
    return out


def test_windows_are_seq_len_plus_one_tokens(prepared):
    s = WindowSampler(prepared.train_tokens(), batch_size=4, seq_len=SEQ, seed=1)
    x, y = s.batch(3)
    assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.int64
    tokens = np.asarray(prepared.train_tokens()).astype(np.int64)
    for row, start in zip(range(4), s.starts(3)[:4]):
        assert x[row].tolist() == tokens[start : start + SEQ].tolist()
        assert y[row].tolist() == tokens[start + 1 : start + SEQ + 1].tolist()
    assert starts_of(x, prepared.train_tokens()) == s.starts(3).tolist()


def test_batch_is_a_pure_function_of_seed_step_rank_world(prepared):
    a = WindowSampler(prepared.train_tokens(), 6, SEQ, seed=7)
    b = WindowSampler(prepared.train_tokens(), 6, SEQ, seed=7)
    for step in (0, 1, 1000, 5):
        for rank in (0, 1):
            assert all(torch.equal(u, v) for u, v in zip(a.batch(step, rank, 2), b.batch(step, rank, 2)))
    # steps differ
    assert not torch.equal(a.batch(0)[0], a.batch(1)[0])
    c = WindowSampler(prepared.train_tokens(), 6, SEQ, seed=8)
    # seeds differ
    assert not torch.equal(a.batch(0)[0], c.batch(0)[0])


def test_ranks_never_overlap_and_world_size_splits_the_global_batch(prepared):
    one = WindowSampler(prepared.train_tokens(), 12, SEQ, seed=3)
    half = WindowSampler(prepared.train_tokens(), 6, SEQ, seed=3)
    quarter = WindowSampler(prepared.train_tokens(), 3, SEQ, seed=3)
    for step in range(20):
        starts = one.starts(step)
        # distinct windows within a global batch
        assert len(set(starts.tolist())) == 12
        x1 = one.batch(step)[0]
        x2 = torch.cat([half.batch(step, r, 2)[0] for r in range(2)])
        x4 = torch.cat([quarter.batch(step, r, 4)[0] for r in range(4)])
        assert torch.equal(x1, x2) and torch.equal(x1, x4)
        rank_starts = [set(quarter.starts(step, 4)[r * 3 : (r + 1) * 3].tolist()) for r in range(4)]
        assert all(rank_starts[i].isdisjoint(rank_starts[j]) for i in range(4) for j in range(i + 1, 4))


def trainer(global_step, accumulate=1, rank=0, world=1):
    return SimpleNamespace(
        global_step=global_step,
        accumulate_grad_batches=accumulate,
        global_rank=rank,
        world_size=world,
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
    )


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_resume_gives_exactly_the_uninterrupted_batches(prepared):
    dm = TokenDataModule(prepared, batch_size=4, seq_len=SEQ, seed=11)
    # no trainer: step 0, rank 0 of 1
    full = take(dm.train_dataloader(), 10)
    resumed = TokenDataModule(prepared, batch_size=4, seq_len=SEQ, seed=11)
    # optimizer step 3 = micro-step 6
    resumed.trainer = trainer(global_step=3, accumulate=2)
    tail = take(resumed.train_dataloader(), 4)
    for (x, y), (rx, ry) in zip(full[6:], tail):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    assert not torch.equal(full[5][0], tail[0][0])


def test_resume_across_ranks_uses_the_global_batch(prepared):
    single = TokenDataModule(prepared, batch_size=8, seq_len=SEQ, seed=2)
    ref = take(single.train_dataloader(), 3)
    parts = []
    for rank in range(2):
        dm = TokenDataModule(prepared, batch_size=4, seq_len=SEQ, seed=2)
        dm.trainer = trainer(global_step=1, rank=rank, world=2)
        parts.append(take(dm.train_dataloader(), 2))
    for i in range(2):
        assert torch.equal(torch.cat([parts[0][i][0], parts[1][i][0]]), ref[1 + i][0])
    # trainer.tensor_parallel=2 on 4 ranks: ranks 2 and 3 form data-parallel rank 1 of 2 (the strategy's
    # distributed_sampler_kwargs), and read the batch rank 1 of a 2-rank job reads
    for global_rank in (2, 3):
        dm = TokenDataModule(prepared, batch_size=4, seq_len=SEQ, seed=2)
        dm.trainer = trainer(global_step=1, rank=global_rank, world=4)
        dm.trainer.strategy.distributed_sampler_kwargs = {"rank": 1, "num_replicas": 2}
        assert torch.equal(take(dm.train_dataloader(), 1)[0][0], parts[1][0][0])


def test_validation_windows_are_fixed(prepared):
    a = TokenDataModule(prepared, batch_size=5, seq_len=SEQ, seed=1, val_windows=12)
    b = TokenDataModule(prepared, batch_size=5, seq_len=SEQ, seed=99, val_windows=12)
    va, vb = list(a.val_dataloader()), list(b.val_dataloader())
    assert [x.shape[0] for x, _, _ in va] == [5, 5, 2]
    assert all(torch.equal(x, u) and torch.equal(y, v) for (x, y, _), (u, v, _) in zip(va, vb))
    assert torch.equal(va[0][0][0, 1:], va[0][1][0, :-1])
    # each window's index (DDP dedup)
    assert torch.cat([i for _, _, i in va]).tolist() == list(range(12))
    every = TokenDataModule(prepared, batch_size=8, seq_len=SEQ, val_windows=None)
    n_val = len(prepared.val_tokens())
    assert sum(x.shape[0] for x, _, _ in every.val_dataloader()) == n_val // (SEQ + 1)


def test_corpus_shorter_than_one_window(prepared):
    with pytest.raises(GptkitError, match="shorter than one window"):
        TokenDataModule(prepared, batch_size=2, seq_len=len(prepared.val_tokens()))
    with pytest.raises(GptkitError, match="fewer than a global batch"):
        WindowSampler(np.arange(20, dtype=np.uint16), batch_size=8, seq_len=SEQ, seed=0).batch(0)


def test_lightning_resume_sees_the_uninterrupted_batches(prepared, tmp_path):
    """Through a real Trainer with gradient accumulation: 3 steps + resume to 6 == 6 steps."""
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 1)
            self.seen = []

        def training_step(self, batch, i):
            x, _ = batch
            self.seen.append(x.tolist())
            return self.emb(x).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(max_steps, ckpt=None):
        model = Recorder()
        trainer = L.Trainer(
            max_steps=max_steps,
            accumulate_grad_batches=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=tmp_path,
            accelerator="cpu",
            devices=1,
        )
        trainer.fit(
            model, datamodule=TokenDataModule(prepared, batch_size=2, seq_len=SEQ, seed=5), ckpt_path=ckpt
        )
        return model.seen, trainer

    full, _ = fit(6)
    first, trainer = fit(3)
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    rest, _ = fit(6, str(tmp_path / "half.ckpt"))
    assert len(full) == 12 and len(first) == len(rest) == 6
    assert first + rest == full
