"""`gptkit bench sample`, its `quantize` part: quantized weights (quantize=int8|w8a8|int4|nf4,
gptkit/quant.py) against the full model on the same run: the weights' bytes, the held-out perplexity
(`gptkit eval`, the run's own val split), greedy agreement (each prompt, a window of held-out text,
continued greedily by both; the share of the generated tokens equal to the full model's, position by
position, and the mean number of tokens before the first difference) and decode tokens/s.

bench.quantize.run names the run; null trains one here first (bench.quantize.model on data=shakespeare with
the byte tokenizer for bench.quantize.train_steps), so that the perplexities are those of a trained model.
int4 runs only with bench.device=cuda (torchao's int4 kernel is CUDA and bf16 only); on the CPU it is left out
and said so.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from gptkit import quant
from gptkit.fsio import human_bytes
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.runs import load_for_inference


def _train(args: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "gptkit", "train", *args], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"bench sample: gptkit train failed:\n{r.stderr[-2000:]}")


def _eval(run: Path, kind: str | None, device: str, dtype: str, windows) -> dict:
    args = [f"run={run}", f"device={device}", f"dtype={dtype}", "progress=false", "--json"]
    if kind is not None:
        args.append(f"quantize={kind}")
    if windows:
        args.append(f"max_windows={windows}")
    r = subprocess.run([sys.executable, "-m", "gptkit", "eval", *args], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"bench sample: gptkit eval quantize={kind} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def _weights(model) -> int:
    return sum(quant.weight_bytes(p) for p in model.parameters())


def run(cfg, device: str, dtype: str) -> dict:
    """The quantize part with the `bench.quantize` group; device and dtype: bench.device's (cpu: fp32)."""
    con = Console(stderr=True, highlight=False)
    kinds = [str(k) for k in cfg.kinds]
    if not device.startswith("cuda") and "int4" in kinds:
        con.print("quantize: int4 left out (torchao's int4 weight-only kernel needs a CUDA GPU)")
        kinds.remove("int4")
    run_dir = Path(str(cfg.run)) if cfg.run else None
    if run_dir is None:
        run_dir = Path(str(cfg.dir)).expanduser() / "trained"
        if run_dir.parent.exists():
            shutil.rmtree(run_dir.parent)
        con.print(f"quantize: training {cfg.model} on shakespeare for {cfg.train_steps} steps ...")
        _train(
            [
                f"model={cfg.model}",
                *[f"model.{k}={v}" for k, v in (OmegaConf.to_container(cfg.model_overrides) or {}).items()],
                "data=shakespeare",
                "tokenizer=byte",
                f"trainer.max_steps={cfg.train_steps}",
                f"trainer.val_every={cfg.train_steps}",
                "trainer.batch_size=8",
                "trainer.progress=false",
                "trainer.accelerator=cpu",
                "optim.lr=3e-3",
                f"runs_dir={run_dir.parent}",
                f"name={run_dir.name}",
            ]
        )
    # prompts: windows of the run's held-out text
    full = load_for_inference(run_dir, device, dtype)
    from gptkit.data import prepare

    val = prepare(full.config["data"], full.config["tokenizer"], progress=False).val_tokens()
    step = max(1, (len(val) - cfg.prompt_tokens) // int(cfg.prompts))
    prompts = [
        [int(t) for t in val[i * step : i * step + int(cfg.prompt_tokens)]] for i in range(int(cfg.prompts))
    ]
    opts = SampleOptions(max_new_tokens=int(cfg.new_tokens), temperature=0.0, eos_id=None)

    def continue_all(model) -> tuple[list[list[int]], float]:
        outs, rates = [], []
        for p in prompts:
            g = generate(model, p, opts)
            outs.append(g.tokens[0])
            rates.append(g.decode_steps / g.decode_s if g.decode_s > 0 else 0.0)
        return outs, statistics.median(rates)

    reference, full_rate = continue_all(full.model)
    rows = {
        "full": {
            "weights": _weights(full.model),
            "eval": _eval(run_dir, None, device, dtype, cfg.eval_windows),
            "agreement": 1.0,
            "first_difference": float(cfg.new_tokens),
            "tokens_per_s": full_rate,
        }
    }
    del full
    for kind in kinds:
        con.print(f"quantize: {kind} ...")
        r = load_for_inference(run_dir, device, dtype, quantize=kind)
        outs, rate = continue_all(r.model)
        same = [sum(a == b for a, b in zip(o, ref)) / max(len(ref), 1) for o, ref in zip(outs, reference)]
        first = [
            next((i for i, (a, b) in enumerate(zip(o, ref)) if a != b), len(ref))
            for o, ref in zip(outs, reference)
        ]
        rows[kind] = {
            "weights": _weights(r.model),
            "eval": _eval(run_dir, kind, device, dtype, cfg.eval_windows),
            "agreement": statistics.mean(same),
            "first_difference": statistics.mean(first),
            "tokens_per_s": rate,
        }
    base = rows["full"]
    table = Table(
        title=f"quantized weights against the full model: {run_dir} ({device}, {dtype}); perplexity on the "
        f"run's val split, greedy agreement over {cfg.prompts} prompts of {cfg.prompt_tokens} tokens x "
        f"{cfg.new_tokens} new"
    )
    for col in (
        "quantize",
        "weights",
        "/ full",
        "perplexity",
        "/ full",
        "same tokens",
        "tokens to 1st difference",
        "decode tokens/s",
    ):
        table.add_column(col, justify="right")
    for kind, r in rows.items():
        table.add_row(
            kind,
            human_bytes(r["weights"]),
            f"{r['weights'] / base['weights']:.3f}",
            f"{r['eval']['perplexity']:.4f}",
            f"{r['eval']['perplexity'] / base['eval']['perplexity']:.4f}",
            f"{r['agreement']:.1%}",
            f"{r['first_difference']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
        )
    Console(width=200).print(table)
    return {"run": str(run_dir), "device": device, "dtype": dtype, "rows": rows}
