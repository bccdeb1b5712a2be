"""`python -m gptkit.torchrun <torchrun's options> -m gptkit train ...`: torchrun itself
(torch.distributed.run: the same options, elastic agent, rendezvous and restarts), except that
- a failure of the rendezvous, which happens before any gptkit process starts, is one line and exit 2 instead
  of the agent's 40-line traceback: a node that never joined within --rdzv-conf join_timeout=<s> (torch's
  default: 600), or an endpoint that cannot be reached;
- with --max-restarts > 0, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 unless set: restarted workers meet in a store
  of their own attempt (with the shared one they can read the previous attempt's addresses and fail or hang,
  pytorch#135712; gptkit train refuses that set-up under plain torchrun).
Everything else (a worker's own errors, torchrun's failure summary) is torchrun's.

    python -m gptkit.torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
      --rdzv-endpoint=$HEAD_NODE:29500 --rdzv-id=my-7b --rdzv-conf join_timeout=300 \\
      -m gptkit train trainer=fsdp trainer.devices=8 trainer.num_nodes=2 name=my-7b
"""

from __future__ import annotations

import os
import sys

SHARE_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# torch.distributed.elastic's own default (dynamic_rendezvous.RendezvousTimeout)
DEFAULT_JOIN_TIMEOUT_S = 600


def join_timeout(rdzv_conf: str) -> float:
    """The join_timeout of torchrun's --rdzv-conf (key=value,...), in seconds."""
    for item in (rdzv_conf or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "join_timeout" and value.strip():
            return float(value)
    return DEFAULT_JOIN_TIMEOUT_S


def rendezvous_failure(args, exc: BaseException) -> str:
    """The one line that says why torchrun's rendezvous failed, and what to do."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    where = f"--rdzv-endpoint={args.rdzv_endpoint} --rdzv-id={args.rdzv_id}"
    if isinstance(exc, RendezvousTimeoutError):
        return (
            f"error: torchrun's rendezvous ({where}) did not complete within join_timeout="
            f"{join_timeout(args.rdzv_conf):g}s: fewer than --nnodes={args.nnodes} nodes joined; start the "
            "same command on every node (the same --rdzv-endpoint and --rdzv-id), or raise --rdzv-conf "
            "join_timeout="
        )
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return (
        f"error: torchrun's rendezvous ({where}) failed: {detail}; check that every node can reach the "
        "endpoint and that its port is free on the first node"
    )


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_restarts > 0:
        # the workers' own store, new each attempt: with the rendezvous's, shared, a restarted worker can read
        # the previous attempt's addresses (pytorch#135712); gptkit train refuses that set-up
        os.environ.setdefault(SHARE_STORE_OFF, "1")
    try:
        # as torchrun's own main: a failed worker's summary (the root cause) is printed, then raised
        record(run)(args)
    except RendezvousError as exc:
        print(rendezvous_failure(args, exc), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
