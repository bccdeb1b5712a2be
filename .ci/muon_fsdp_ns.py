"""Time MuonWithAdamW's step under FSDP2 on 2 gloo CPU processes: Newton-Schulz shared out by matrix (each
rank orthogonalizes every other matrix, the default) against every rank orthogonalizing every matrix
(sharded_ns=False), alternating, on the same gradients; and check that both give the same weights.

    python .ci/muon_fsdp_ns.py [N_LAYERS D_MODEL REPEATS NS_DTYPE]      (default: 4 512 5 bfloat16)

Prints the median step time of each (rank 0's wall clock) and their ratio. One thread per process.
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def rank_main(rank: int, init: str, n_layers: int, d_model: int, repeats: int, ns_dtype: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gptkit.model import GPT, ModelConfig
    from gptkit.training.optim import build_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    cfg = OmegaConf.create(
        dict(
            name="muon",
            lr=1e-3,
            betas=[0.9, 0.95],
            eps=1e-8,
            weight_decay=0.1,
            decay_embeddings=False,
            decay_norms_and_biases=False,
            fused="auto",
            muon=dict(
                momentum=0.95, nesterov=True, ns_steps=5, ns_dtype=ns_dtype, adjust_lr="match_rms_adamw"
            ),
        )
    )
    models = []
    # the same weights and gradients twice: one optimizer per way of orthogonalizing
    for _ in range(2):
        torch.manual_seed(0)
        model = GPT(
            ModelConfig(
                vocab_size=256,
                max_seq_len=32,
                n_layers=n_layers,
                n_heads=max(1, d_model // 64),
                d_model=d_model,
            )
        )
        mesh = init_device_mesh("cpu", (2,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))  # [B, T]
        model(x, torch.roll(x, -1, 1)).loss.backward()
        models.append((model, build_optimizer(model, cfg)))
    models[1][1].sharded_ns = False
    seconds = {True: [], False: []}
    for _ in range(repeats):
        for _, opt in models:
            dist.barrier()
            t = time.perf_counter()
            opt.step()
            dist.barrier()
            seconds[opt.sharded_ns].append(time.perf_counter() - t)
    same = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(models[0][0].parameters(), models[1][0].parameters())
    )
    if rank == 0:
        n = sum(p.numel() for p in models[0][0].parameters())
        shard, whole = statistics.median(seconds[True]), statistics.median(seconds[False])
        print(
            f"{n_layers} layers x d_model {d_model} ({n / 1e6:.1f}M parameters), ns_dtype={ns_dtype}, "
            f"{repeats} steps each: shared out {shard * 1e3:.0f} ms, every rank every matrix "
            f"{whole * 1e3:.0f} ms per step: {shard / whole:.2f}x; the same weights: {same}"
        )
    dist.destroy_process_group()


def main() -> None:
    n_layers, d_model, repeats = (int(a) for a in (sys.argv[1:4] or ["4", "512", "5"]))
    ns_dtype = sys.argv[4] if len(sys.argv) > 4 else "bfloat16"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank",
                    str(r),
                    f"{tmp}/init",
                    str(n_layers),
                    str(d_model),
                    str(repeats),
                    ns_dtype,
                ],
                env=env,
            )
            for r in range(2)
        ]
        codes = [p.wait() for p in ranks]
    sys.exit(max(codes))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(int(sys.argv[2]), sys.argv[3], *(int(a) for a in sys.argv[4:7]), sys.argv[7])
    else:
        main()
