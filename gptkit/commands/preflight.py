"""Takes the same overrides as `gptkit train`, starts the same processes (or joins the ones torchrun or
SLURM started) and checks, in seconds rather than an hour into the job: the world size and ranks (each
rank's host and SLURM node), the backend, one all-reduce across every rank, the all-reduce bandwidth per
link (bus bandwidth of a 16 MiB fp32 all-reduce; loopback when every rank is on one host), and each
device's memory against the count-params estimate of training memory for this model, precision, strategy
and batch. No data, no training.

Examples:
  gptkit preflight trainer=ddp trainer.devices=8 model=gpt2
  gptkit preflight trainer=fsdp trainer.devices=8 model=llama3-8b trainer.batch_size=2
  torchrun --nnodes=2 --nproc-per-node=8 ... -m gptkit preflight trainer=fsdp \\
      trainer.devices=8 trainer.num_nodes=2
Exit status 0 when every check passes, 2 (with one line saying which) when one fails.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import warnings

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def _device_memory(device: str, per_node: int) -> tuple[float, float]:
    """(total, free) bytes available to one process: its GPU, or this node's RAM shared by its processes."""
    import torch

    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return float(total), float(free)
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page / per_node
    free = os.sysconf("SC_AVPHYS_PAGES") * page / per_node
    return float(total), float(free)


def _probe(fabric, per_node: int) -> dict:
    from gptkit.training.distributed import probe_bandwidth, probe_collective

    device = str(fabric.device)
    if fabric.world_size > 1:
        result = {**probe_collective(device), **probe_bandwidth(device)}
    else:
        result = {"sum": 0.0, "expected": 0.0, "seconds": 0.0, "backend": "none (one process)"}
    total, free = _device_memory(device, per_node)
    return {
        "rank": fabric.global_rank,
        "host": socket.gethostname(),
        # the scheduler's name for this node (SLURM's NodeName), beside the host's own
        "node": os.environ.get("SLURMD_NODENAME", "-"),
        "device": device,
        "device_name": _device_name(device),
        "mem_total": total,
        "mem_free": free,
        **result,
    }


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def run(cfg) -> int:
    from gptkit.training.config_checks import check_values

    # train's value checks before torch and Lightning are imported (a refused trainer value: 0.3 s of CPU,
    # not 5 s: docs/benchmarks.md, "Issue 47, start-up")
    check_values(cfg, new_model=False)
    from lightning.fabric import Fabric

    from gptkit.conf_tree import model_config
    from gptkit.errors import GptkitError
    from gptkit.training.memory import estimate as memory_estimate
    from gptkit.training.plan import make_plan
    from gptkit.training.trainer import check_trainer_config

    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.distributed"):
        # our table says it all
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*GLOO_SOCKET_IFNAME.*")
    t = cfg.trainer
    # the same one-line errors as `train`, before any process starts
    checked = check_trainer_config(t)
    model = model_config(cfg.model)
    # the plan `train` would make, without data: the same world and window
    plan = make_plan(cfg, None, model, checked=checked)
    per_node, world = plan.devices, plan.world_size
    # as train's host check: LoRA's adapters, DPO's pairs and reference
    estimate = memory_estimate(plan)
    estimate["seq_len"] = plan.seq_len
    estimate["mesh"] = mesh_line(plan)

    # the probe runs over the same backend as training (nccl on GPUs, gloo on CPU) in a plain DDP group
    fabric = Fabric(
        accelerator=t.accelerator,
        devices=per_node,
        num_nodes=int(t.num_nodes),
        strategy="ddp" if world > 1 else "auto",
    )
    fabric.launch()
    rows = [_probe(fabric, per_node)]
    if world > 1:
        import torch.distributed as dist

        gathered: list = [None] * world
        dist.all_gather_object(gathered, rows[0])
        rows = gathered
    if fabric.global_rank != 0:
        return 0
    problems = _report(cfg, rows, world, per_node, estimate, model)
    if problems:
        raise GptkitError("preflight failed: " + "; ".join(problems))
    return 0


def memory_advice(t) -> str:
    """What lowers the memory per device, leaving out what the `trainer` group `t` already does."""
    ways = [] if str(t.strategy) == "fsdp" else ["trainer=fsdp"]
    ways.append("more devices")
    if int(t.batch_size) > 1:
        ways.append("a smaller trainer.batch_size")
    from gptkit.training.config_checks import checkpointing_mode

    if checkpointing_mode(t) != "full":
        ways.append("trainer.activation_checkpointing=true")
    if str(t.precision) != "bf16-true":
        ways.append("trainer.precision=bf16-true")
    return ways[0] if len(ways) == 1 else ", ".join(ways[:-1]) + " or " + ways[-1]


def mesh_line(plan) -> str:
    """The run's mesh (dp x cp x tp, ep) and the bytes one GPU sends per micro-step by kind
    (gptkit/parallel_plan.py)."""
    from gptkit.fsio import human_bytes
    from gptkit.parallel_plan import Mesh, communication, recomputed_layers
    from gptkit.training.config_checks import checkpointing_mode
    from gptkit.training.memory import plan_mesh

    mesh = plan_mesh(plan) or Mesh(plan.world_size, ep=plan.expert_shards)
    fsdp = plan.strategy == "fsdp"
    t = plan.trainer
    recomputed = recomputed_layers(
        plan.model,
        checkpointing_mode(t),
        str(t.get("activation_checkpointing_policy", "ops")),
        int(t.get("activation_checkpointing_every", 2)),
    )
    comm = communication(
        plan.model, mesh, plan.precision, plan.rows, plan.seq_len, fsdp=fsdp, recomputed=recomputed
    )
    kinds = ", ".join(f"{k} {human_bytes(v)}" for k, v in comm.items() if k != "total")
    return (
        f"{mesh.n_gpus} = dp {mesh.dp} x cp {mesh.cp} x tp {mesh.tp}"
        + (f", ep {mesh.ep}" if mesh.ep else "")
        + (f"; sent per GPU and micro-step: {human_bytes(comm['total'])} ({kinds})" if kinds else "")
    )


def bandwidth_line(rows: list[dict]) -> str:
    """The all-reduce bandwidth per link: the slowest rank's bus bandwidth (probe_bandwidth), and what the
    links are: loopback when every rank is on one host, else the network between the hosts."""
    from gptkit.fsio import human_bytes

    slowest = min(rows, key=lambda r: r["busbw"])
    hosts = sorted({r["host"] for r in rows})
    links = (
        f"loopback: every rank on host {hosts[0]}, no network link measured"
        if len(hosts) == 1
        else f"the network between {len(hosts)} hosts"
    )
    return (
        f"{slowest['busbw'] / 1e9:.2f} GB/s per link (bus bandwidth, size/time x 2(n-1)/n, slowest rank "
        f"{slowest['rank']}: {human_bytes(slowest['bw_bytes'])} all-reduced in "
        f"{slowest['bw_seconds'] * 1e3:.1f} ms), over {links}"
    )


def _report(cfg, rows: list[dict], world: int, per_node: int, estimate: dict, model) -> list[str]:
    from rich.console import Console
    from rich.table import Table

    from gptkit.fsio import human_bytes

    t = cfg.trainer
    margin = float(cfg.memory_margin)
    problems = []
    con = Console()
    ranks = sorted(r["rank"] for r in rows)
    if ranks != list(range(world)):
        problems.append(f"ranks {ranks} answered, expected 0..{world - 1}")
    bad_sum = [r for r in rows if abs(r["sum"] - r["expected"]) > 1e-6]
    if bad_sum:
        problems.append(
            f"the all-reduce gave {bad_sum[0]['sum']} on rank {bad_sum[0]['rank']}, "
            f"expected {bad_sum[0]['expected']}"
        )
    need = estimate["total"]
    short = [r for r in rows if need > margin * r["mem_total"]]
    if short:
        r = short[0]
        problems.append(
            f"training needs ~{human_bytes(need)} per device (count-params estimate) but rank "
            f"{r['rank']} has {human_bytes(r['mem_total'])}; use {memory_advice(t)}"
        )

    summary = Table(title=f"gptkit preflight: {model.name}, strategy {t.strategy}, precision {t.precision}")
    summary.add_column("check")
    summary.add_column("value")
    summary.add_column("", justify="center")
    ok = lambda good: "[green]ok[/]" if good else "[red]FAIL[/]"  # noqa: E731
    hosts = sorted({r["host"] for r in rows})
    summary.add_row(
        "world size",
        f"{world} = {per_node} devices x {int(t.num_nodes)} nodes "
        f"({len(hosts)} host(s): "
        f"{', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''})",
        ok(len(rows) == world and ranks == list(range(world))),
    )
    summary.add_row("backend", rows[0]["backend"], "")
    slowest = max(r["seconds"] for r in rows)
    summary.add_row(
        "all-reduce of the ranks",
        f"sum {rows[0]['sum']:g} (expected {rows[0]['expected']:g}), slowest rank {slowest * 1e3:.1f} ms",
        ok(not bad_sum),
    )
    if "busbw" in rows[0]:
        summary.add_row("all-reduce bandwidth", bandwidth_line(rows), "")
    summary.add_row(
        "training memory per device (estimate)",
        f"{human_bytes(need)}: weights {human_bytes(estimate['weights'])}"
        + (
            f", the {cfg.objective} reference {human_bytes(estimate['reference'])}"
            if "reference" in estimate
            else ""
        )
        + f", grads {human_bytes(estimate['gradients'])}, optimizer ({cfg.optim.name}) "
        f"{human_bytes(estimate['optimizer'])}, "
        f"activations {human_bytes(estimate['activations'])}, logits "
        f"{human_bytes(estimate['logits'])} (batch {int(t.batch_size)} x "
        f"{estimate['seq_len']})",
        "",
    )
    summary.add_row("mesh (docs/parallelism.md)", estimate["mesh"], "")
    smallest = min(r["mem_total"] for r in rows)
    summary.add_row(
        "smallest device memory",
        f"{human_bytes(smallest)} (limit {margin:.0%}: {human_bytes(margin * smallest)})",
        ok(not short),
    )
    con.print(summary)
    devices = Table(title="ranks")
    for c in ("rank", "host", "node", "device", "name", "memory", "free", "bus GB/s"):
        devices.add_column(c)
    for r in sorted(rows, key=lambda r: r["rank"]):
        devices.add_row(
            str(r["rank"]),
            r["host"],
            r["node"],
            r["device"],
            r["device_name"],
            human_bytes(r["mem_total"]),
            human_bytes(r["mem_free"]),
            f"{r['busbw'] / 1e9:.2f}" if "busbw" in r else "-",
        )
    con.print(devices)
    return problems
