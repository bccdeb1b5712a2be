#!/usr/bin/env python3
"""Context parallelism x tensor parallelism against one process (issue 58 item 3): 4 gloo processes on the
trainer's one DeviceMesh (training/mesh.py: cp 2, tp 2, tp innermost). apply_tensor_parallel on mesh["tp"]
(heads, MLP columns, vocabulary; sequence parallelism inside each CP rank's share), FSDP2 over mesh.fsdp
(dp_shard x cp), then ContextParallel on mesh["cp"]'s group (the ring over TP-local heads), against the same
model (float64) run whole in one process, for a few optimizer steps (AdamW).

Per case it prints the largest differences of: the loss of every step (each rank's mean over its loss tokens
under loss_parallel, weighted by its tokens and summed over the CP ranks), the loss per token of the first
step (every rank's share gathered back in sequence order), the gradients of the first step (full tensors, the
q/k/v parts fused back) and the weights after the last step; exit 1 when one exceeds TOL.
Then the CLI: `gptkit train` on 4 processes (cp 2, tp 2) against one process (cli_check).
By hand: `python .ci/context_tensor_parallel.py [STEPS | --cli]` in an activated venv.
"""

import os
import sys
import tempfile
import time
from pathlib import Path

import parallel_harness as h
import torch
import torch.distributed as dist
import torch.nn.functional as F

TOL = 1e-5
CP, TP = 2, 2
B, T = 2, 64

LLAMA = dict(h.LLAMA, max_seq_len=T)
GPT2 = dict(h.GPT2, max_seq_len=T)
# (name, model, packed documents)
CASES = [
    (
        "llama GQA 4:2, docs + position_reset, window 11 (local, global), sdpa",
        dict(LLAMA, position_reset=True, sliding_window=11, layer_types=["local", "global"]),
        True,
    ),
    (
        "llama GQA 4:2 tied, one document per row, eager",
        dict(LLAMA, tie_embeddings=True, attention="eager"),
        False,
    ),
    (
        "llama MQA 4:1 (K/V replicated over tp), qk_norm=head, docs",
        dict(LLAMA, n_kv_heads=1, qk_norm="head"),
        True,
    ),
    ("gpt2 tied, learned positions + position_reset, docs", dict(GPT2, position_reset=True), True),
]


def batches(steps, vocab, docs):
    """(idx, targets, doc_ids or None) per step: documents of random lengths crossing the chunks, a few
    ignored targets."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, vocab, (B, T), generator=g)
        targets = torch.randint(0, vocab, (B, T), generator=g)
        targets[torch.rand(B, T, generator=g) < 0.05] = -100
        doc_ids = torch.cumsum((torch.rand(B, T, generator=g) < 6 / T).long(), 1) if docs else None
        out.append((idx, targets, doc_ids))
    return out


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def one_process(cfg_dict, state, data):
    """The reference: losses per step, per-token losses and gradients of step 1, final weights."""
    from gptkit.model import GPT, ModelConfig

    model = GPT.from_state(ModelConfig.from_dict(cfg_dict), state).train()
    opt = optimizer(model)
    losses, tok, grads = [], None, None
    for i, (idx, targets, doc_ids) in enumerate(data):
        out = model(idx, targets, doc_ids=doc_ids)
        out.loss.backward()
        losses.append(float(out.loss))
        if i == 0:
            tok = F.cross_entropy(out.logits.detach().transpose(1, 2), targets, reduction="none")
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, tok, grads, model.state_dict()


def full_state(named) -> dict:
    """{name: full tensor} of DTensors (FSDP2 over cp, TP over tp) with the q/k/v parts fused back."""
    from gptkit.model.mha import fuse_qkv_state

    return fuse_qkv_state({k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in named})


def worker(rank, world, port, steps, tmp):
    h.start_rank(rank, world, port)
    from torch.distributed.fsdp import fully_shard

    from gptkit.training.context_parallel import ContextParallel
    from gptkit.training.mesh import MeshDims, build_mesh
    from gptkit.training.tensor_parallel import apply_tensor_parallel, local_loss, loss_context

    # the trainer's one mesh (training/mesh.py): dp_shard 1 x cp 2 x tp 2
    mesh = build_mesh("cpu", MeshDims(world=world, cp=CP, tp=TP))
    for i, (_, cfg_dict, docs) in enumerate(CASES):
        model = h.initial_model(cfg_dict, tmp, i)
        apply_tensor_parallel(model, mesh["tp"])
        for block in model.blocks:
            fully_shard(block, mesh=mesh.fsdp)
        fully_shard(model, mesh=mesh.fsdp)
        cp = ContextParallel(model, mesh["cp"].get_group())
        opt = optimizer(model)
        losses, tok, grads = [], None, None
        t0 = time.perf_counter()
        for s, (idx, targets, doc_ids) in enumerate(batches(steps, model.cfg.vocab_size, docs)):
            n_all = (targets != -100).sum()
            with loss_context(model):
                x, y = cp.enter((idx, targets, doc_ids) if docs else (idx, targets))
                try:
                    out = model(x, y)
                finally:
                    cp.exit()
                loss = local_loss(out.loss)  # the mean over this rank's loss tokens
                n = (y != -100).sum()
                # the trainer's token mean: each rank's loss weighted by its tokens; FSDP2 averages over cp
                (loss * n / n_all * CP).backward()
            step_loss = (loss.detach() * n / n_all).clone()
            dist.all_reduce(step_loss, group=mesh["cp"].get_group())
            losses.append(float(step_loss))
            if s == 0:
                logits = out.logits.detach().full_tensor()
                tok = cp.gather(F.cross_entropy(logits.transpose(1, 2), y, reduction="none"))
                grads = full_state((k, p.grad) for k, p in model.named_parameters())
            opt.step()
            opt.zero_grad()
        seconds = time.perf_counter() - t0
        weights = full_state(model.state_dict().items())
        if rank == 0:
            torch.save(
                {"losses": losses, "tok": tok, "grads": grads, "state": weights, "seconds": seconds},
                Path(tmp) / f"out{i}.pt",
            )
        dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    # `gptkit ARGS` on more CPU processes than cores (cli_check); Lightning starts the other ranks with this
    # script's own command line, so they come through here too (the verb in the environment)
    if sys.argv[1:2] == ["--gptkit"]:
        return h.gptkit_with_cores(sys.argv[2:], CP * TP)
    if os.environ.get("GPTKIT_VERB"):
        return h.gptkit_with_cores(None, CP * TP)
    if sys.argv[1:2] == ["--cli"]:
        return 0 if cli_check() else 1
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    h.float64_one_thread()
    started = time.perf_counter()
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        models = h.initial_models([c[1] for c in CASES], tmp)
        refs = [
            one_process(cfg_dict, m.state_dict(), batches(steps, m.cfg.vocab_size, docs))
            for m, (_, cfg_dict, docs) in zip(models, CASES)
        ]
        one_s = time.perf_counter() - started
        h.spawn(worker, CP * TP, steps, tmp)
        print(f"== context_parallel={CP} x tensor_parallel={TP} (4 gloo processes) vs one process, float64")
        for i, (name, _, _) in enumerate(CASES):
            got = torch.load(Path(tmp) / f"out{i}.pt")
            losses, tok, grads, state = refs[i]
            assert set(got["grads"]) == set(grads) and set(got["state"]) == set(state)
            d_loss = max(abs(a - b) for a, b in zip(losses, got["losses"]))
            d_tok = (got["tok"] - tok).abs().max().item()
            d_grad = max((got["grads"][k] - g).abs().max().item() for k, g in grads.items())
            d_w = max((got["state"][k] - w).abs().max().item() for k, w in state.items())
            worst = max(worst, d_loss, d_tok, d_grad, d_w)
            print(
                f"{name:72s} {steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}: max |d loss| "
                f"{d_loss:.1e}, |d loss/token| {d_tok:.1e}, |d grad| {d_grad:.1e}, |d weight| {d_w:.1e}"
            )
    print(
        f"worst difference {worst:.1e} ({'ok' if worst <= TOL else 'FAILED'}: bound {TOL:g}); one process "
        f"{one_s:.1f} s, all {time.perf_counter() - started:.1f} s"
    )
    return 0 if worst <= TOL and cli_check() else 1


CLI_STEPS = 4


def cli_check() -> bool:
    """`gptkit train trainer=fsdp trainer.devices=4 trainer.context_parallel=2 trainer.tensor_parallel=2`
    against one process: a Llama (GQA 4:2, RoPE) on packed documents with positions restarting in each and a
    sliding window on its local layers, fp32; every logged train loss and grad norm, the val losses."""
    env = h.cli_env()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # documents of 20 to 120 characters (a text file is one), packed with an EOS between them
        text, at, docs = h.shakespeare(20_000), 0, Path(tmp) / "docs"
        docs.mkdir()
        for i in range(10**6):
            n = 20 + (i * 37) % 101
            if at + n > len(text):
                break
            (docs / f"{i:04d}.txt").write_text(text[at : at + n])
            at += n

        def train(name: str, *extra: str) -> dict[int, dict[str, str]]:
            h.run_gptkit(
                [sys.executable, __file__, "--gptkit", *h.tiny_train("llama-tiny", CLI_STEPS, 2, tmp, name),
                 "model.d_ff=64", "model.attention=eager", "model.position_reset=true",
                 "model.sliding_window=12", "model.layer_types=[local,global]",
                 "tokenizer.eos_token='<|eos|>'", f"data.paths=['{docs}/*.txt']", "data.pack=documents",
                 "trainer.batch_size=4", *extra],
                env,
            )  # fmt: skip
            return {int(row["step"]): row for row in h.metrics(Path(tmp) / name)}

        one = train("one")
        t0 = time.perf_counter()
        mesh = train(
            "cp2tp2",
            "trainer=fsdp",
            "trainer.devices=4",
            "trainer.context_parallel=2",
            "trainer.tensor_parallel=2",
        )
        mesh_s = time.perf_counter() - t0
    diffs = {}
    for step, want in one.items():
        for key in ("train/loss", "train/grad_norm", "val/loss", "perf/tokens"):
            if want.get(key):
                d = abs(float(mesh[step][key]) - float(want[key]))
                diffs[key] = max(diffs.get(key, 0.0), d)
    ok = sorted(one) == sorted(mesh) == list(range(1, CLI_STEPS + 1)) and max(diffs.values()) <= TOL
    figures = ", ".join(f"max |d {k}| {v:.1e}" for k, v in diffs.items())
    print(
        f"CLI: gptkit train trainer.devices=4 context_parallel=2 tensor_parallel=2 vs one process, "
        f"{CLI_STEPS} steps: {figures} ({'ok' if ok else 'FAILED'}; 4 processes {mesh_s:.1f} s, all "
        f"{time.perf_counter() - started:.1f} s)"
    )
    return ok


if __name__ == "__main__":
    sys.exit(main())
