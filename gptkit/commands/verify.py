"""Before a long run: the same overrides as `gptkit train`, rehearsed at tiny width on the CPU (minutes), and
gptkit's invariants checked on that config, one line each (gptkit/training/verify.py):

    ranks         2 ranks = 1 rank
    accumulation  accumulation 2 = batch x 2
    resume        resume after a kill = uninterrupted (bit for bit)
    packing       packed documents = unpacked
    export        export -> import parity (and transformers' model of the exported folder)

Examples:
  gptkit verify model=llama-tiny data=files 'data.paths=[corpus.txt]' optim=muon
  gptkit verify experiment=sft-tiny invariants=[accumulation,resume]
  gptkit verify trainer=fsdp trainer.precision=bf16-mixed dir=runs/verify    (keep the rehearsal runs)
Exit status 0 when every invariant holds (or does not apply: skip), 1 when one fails, 2 for bad input.
"""

from __future__ import annotations

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def run(cfg) -> int:
    from gptkit.training.config_checks import check_values

    # train's value checks before torch and Lightning are imported (a refused trainer value: 0.3 s of CPU,
    # not 5 s: docs/benchmarks.md, "Issue 47, start-up")
    check_values(cfg, new_model=False)
    from gptkit.training.verify import check_invariants, verify

    # an unknown invariant before anything is imported or trained
    check_invariants(cfg.invariants)
    return verify(cfg)
