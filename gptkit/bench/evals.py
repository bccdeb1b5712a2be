"""`gptkit bench evals`: lm-eval loglikelihood requests per second of gptkit's LM adapter
(gptkit.evaluation.lm_eval_adapter) against lm-eval's own `hf` backend, on the same weights (a random
model of bench.model, loaded into transformers through gptkit.hf.to_transformers) and the same requests.

The task is built on the spot from the built-in corpus, so nothing is downloaded: a question is
bench.context_lines lines of the play, its four choices the true next line and three lines from elsewhere.
Only the LM's `loglikelihood` call is timed (lm-eval builds the requests once for both sides); the sides
alternate bench.repeats times after one warm-up each, and the median is reported with the min-max. The
per-request log-likelihoods of the two sides are compared (max difference) and so are the accuracies.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.table import Table

from gptkit.data.sources import shakespeare_text
from gptkit.evaluation import tasks as T
from gptkit.evaluation.lm_eval_adapter import GptkitLM
from gptkit.hf import to_transformers
from gptkit.threads import set_threads
from gptkit.tokenizer import train_bpe


def build_task(folder: Path, questions: int, context_lines: int, seed: int = 0) -> Path:
    """A multiple-choice task YAML + jsonl in folder from the built-in Shakespeare text."""
    lines = [s.strip() for s in shakespeare_text().splitlines() if len(s.strip()) > 20]
    rnd = random.Random(seed)
    rows = []
    for _ in range(questions):
        i = rnd.randrange(context_lines, len(lines) - 1)
        wrong = rnd.sample(range(len(lines)), 3)
        choices = [lines[i]] + [lines[j] for j in wrong]
        order = list(range(4))
        rnd.shuffle(order)
        rows.append(
            {
                "context": " ".join(lines[i - context_lines : i]),
                "choices": [choices[k] for k in order],
                "answer": order.index(0),
            }
        )
    (folder / "bench_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {
        "task": "bench_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(folder / "bench_mc.jsonl")}},
        "output_type": "multiple_choice",
        "test_split": "test",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    path = folder / "bench_mc.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False))
    return path


def run(cfg) -> int:
    from transformers import PreTrainedTokenizerFast

    from gptkit.bench.decode import build_model

    T.require_lm_eval()
    T.quiet_lm_eval()
    from lm_eval.models.huggingface import HFLM

    set_threads(cfg.threads, "bench.threads")
    eos = "<|endoftext|>"
    tok = train_bpe(lambda: [shakespeare_text()], int(cfg.tokenizer_vocab), [eos], progress=False)
    spec = dict(cfg.model)
    spec["vocab_size"] = tok.get_vocab_size()
    model = build_model(spec)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    ours = GptkitLM(model, tok, {"tokenizer": {"eos_token": eos}}, batch_size=int(cfg.batch_size))
    theirs = HFLM(
        pretrained=to_transformers(model),
        tokenizer=hf_tok,
        batch_size=int(cfg.batch_size),
        device="cpu",
        max_length=model.cfg.max_seq_len,
    )

    with tempfile.TemporaryDirectory(prefix="gptkit-bench-evals-") as tmp:
        specs = T.find_tasks([str(build_task(Path(tmp), int(cfg.questions), int(cfg.context_lines)))])
        manager = T.task_manager(specs)
        task = T.leaf_tasks(T.load_tasks(specs, manager))["bench_mc"]
        task.set_config("num_fewshot", int(cfg.num_fewshot))
        task.build_all_requests(limit=None, rank=0, world_size=1)
        requests = [inst for inst in task.instances]

    def timed(lm) -> tuple[float, list]:
        t0 = time.perf_counter()
        out = lm.loglikelihood(requests, disable_tqdm=True)
        return time.perf_counter() - t0, out

    # warm-up
    timed(ours), timed(theirs)
    times: dict[str, list[float]] = {"gptkit": [], "hf": []}
    for _ in range(int(cfg.repeats)):
        for name, lm in (("gptkit", ours), ("hf", theirs)):
            seconds, out = timed(lm)
            times[name].append(seconds)
            if name == "gptkit":
                a = out
            else:
                b = out
    n = len(requests)
    rate = {k: n / statistics.median(v) for k, v in times.items()}
    diff = max(abs(x[0] - y[0]) for x, y in zip(a, b))

    def accuracy(res) -> float:
        per_doc: dict[int, list[float]] = {}
        for inst, (ll, _) in zip(requests, res):
            per_doc.setdefault(inst.doc_id, []).append(ll)
        docs = {d["__idx"] if "__idx" in d else i: d for i, d in enumerate(task.test_docs())}
        hits = [max(range(len(v)), key=v.__getitem__) == docs[k]["answer"] for k, v in per_doc.items()]
        return sum(hits) / len(hits)

    t = Table(
        title=f"lm-eval loglikelihood requests/s, {model.cfg.name} ({model.num_parameters():,} "
        f"parameters, context {model.cfg.max_seq_len}), {n} requests ({cfg.questions} questions "
        f"x 4), CPU, "
        f"{torch.get_num_threads()} thread(s): median of {cfg.repeats} (min-max)"
    )
    for col in ("side", "requests/s", "seconds", "accuracy"):
        t.add_column(col, justify="left" if col == "side" else "right")
    for name, res in (("gptkit adapter", a), ("lm-eval hf", b)):
        key = "gptkit" if name.startswith("gptkit") else "hf"
        v = times[key]
        t.add_row(
            name,
            f"{rate[key]:,.0f} ({n / max(v):,.0f}-{n / min(v):,.0f})",
            f"{statistics.median(v):.2f}",
            f"{accuracy(res):.3f}",
        )
    con = Console()
    con.print(t)
    con.print(
        f"speed-up {rate['gptkit'] / rate['hf']:.2f}x; max |log-likelihood difference| {diff:.2e}; "
        f"gptkit ran {ours.stats.forward_tokens:,} tokens through the model in all"
    )
    results = {
        "requests": n,
        "threads": torch.get_num_threads(),
        "model": dict(spec),
        "seconds": times,
        "requests_per_s": rate,
        "speedup": rate["gptkit"] / rate["hf"],
        "max_ll_diff": diff,
        "accuracy": {"gptkit": accuracy(a), "hf": accuracy(b)},
    }
    if cfg.out:
        from gptkit.fsio import atomic_write_text

        atomic_write_text(Path(str(cfg.out)), json.dumps(results, indent=2))
        print(f"results: {cfg.out}", file=sys.stderr)
    return 0
