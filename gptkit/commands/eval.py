"""Loss (nats/token), perplexity, bits per byte and bits per character of a run on a corpus, over
every window of the split (not a sample). Every token after the first is scored exactly once: with
stride=seq_len (the default) the windows do not overlap; with a smaller stride each window scores
only its last `stride` targets, which then see at least seq_len - stride tokens of context.

Bits per byte = total NLL / ln 2 / UTF-8 bytes of the scored text (per character: / characters),
comparable across tokenizers.

scoring=gptkit (the default) scores the corpus as training saw it: one stream, the EOS after each document
scored (0 bytes), the first token not. scoring=lm-eval scores as lm-eval's loglikelihood_rolling does: each
document alone, a BOS first (the EOS without one), every token scored, no EOS (docs/tasks.md).

tasks=... runs lm-eval tasks on the run through gptkit's own LM adapter (needs pip install "gptkit[eval]"):
names from lm-eval's registry, task YAMLs or folders of them (local data runs offline); a table of task,
metric, value and stderr, and the results in <run>/evals/<task>-<date>.json (or out=).

Examples:
  gptkit eval run=runs/shakespeare                       (the run's own val split)
  gptkit eval run=runs/shakespeare data=files 'data.paths=[held_out.txt]'   (a whole held-out file)
  gptkit eval run=runs/shakespeare stride=64 format=json
  gptkit eval run=runs/shakespeare data=files 'data.paths=[wiki.jsonl]' scoring=lm-eval
  gptkit eval run=runs/my-run tasks=hellaswag,arc_easy limit=200 num_fewshot=0
  gptkit eval run=runs/my-run tasks=path/to/my_tasks --json
A run trained with data.pack=documents is evaluated the same way (attention stays inside each document of a
window, positions restart with model.position_reset); pack=stream|documents chooses.
"""

from __future__ import annotations

import json
import math
import sys
import time

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).

# options of tasks=
TASK_ONLY = ("limit", "num_fewshot", "out", "decontaminate", "samples", "k")
# options of the corpus evaluation
CORPUS_ONLY = ("split", "seq_len", "stride", "max_windows", "pack")


def prepare_args(args: list[str]) -> list[str]:
    """tasks=a,b is one value (a list of tasks), not a Hydra sweep; run=s3://... is downloaded (its newest
    complete checkpoint, gptkit/remote.py)."""
    from gptkit.conf_tree import verbatim
    from gptkit.remote import localize_args

    return localize_args(verbatim(args, ("tasks",)), {"run": "run"})


def corpus_tokens(cfg, r):
    """(tokens [N] numpy, description, EOS id or None): the split of the held-out corpus or of the run's own
    data."""
    import numpy as np

    from gptkit.data import check_scored, prepare
    from gptkit.errors import GptkitError
    from gptkit.runs import TOKENIZER_FILE

    run_tok = r.config.get("tokenizer") or {}
    data = cfg.get("data") if cfg.get("data") is not None else r.config.get("data") or {}
    # a kind that is not one token stream (conversations, pairs) has no windows to score
    check_scored(data)
    if cfg.get("data") is None:
        if "data" not in r.config or "tokenizer" not in r.config:
            raise GptkitError(
                f"{r.dir}/config.yaml has no data/tokenizer sections to find its val split; "
                f"pass a corpus: data=files 'data.paths=[held_out.txt]'"
            )
        p = prepare(r.config["data"], run_tok, progress=False)
        if p.tokenizer().to_str() != r.tokenizer.to_str():
            raise GptkitError(
                f"the run's data ({p.dir}) was tokenized with another tokenizer than "
                f"{r.dir / TOKENIZER_FILE}; evaluate on data=... instead"
            )
        split = cfg.split or "val"
    # a held-out corpus, tokenized with exactly the run's tokenizer.json
    else:
        tok_cfg = {"kind": "file", "path": str(r.dir / TOKENIZER_FILE), "eos_token": run_tok.get("eos_token")}
        p = prepare(cfg.data, tok_cfg, progress=False)
        split = cfg.split or "all"
    if split == "all":
        # the tail split: train then val
        tokens = np.concatenate([p.train_tokens(), p.val_tokens()])
    elif split in ("train", "val"):
        tokens = p.train_tokens() if split == "train" else p.val_tokens()
    else:
        raise GptkitError(f"split={split!r} is not one of val, train, all")
    return tokens, f"{p.manifest['source']['description'] or p.dir.name} ({split})", p.eos_id


def pack_eos_id(cfg, r, eos_id: int | None, source: str) -> int | None:
    """The EOS id that separates documents when the windows are evaluated as packed documents (pack=, by
    default the run's own data.pack), else None."""
    from gptkit.errors import ConfigError

    if (cfg.pack or (r.config.get("data") or {}).get("pack") or "stream") == "stream":
        return None
    if eos_id is None:
        raise ConfigError(
            f"pack=documents needs an EOS token between documents and {source} has none; use pack=stream"
        )
    return eos_id


def run(cfg) -> int:
    from gptkit.errors import ConfigError
    from gptkit.runs import find_run_checkpoint

    if cfg.format not in ("table", "json"):
        raise ConfigError(f"format={cfg.format!r} must be table or json")
    if int(cfg.batch_size) < 1:
        raise ConfigError(f"batch_size={cfg.batch_size} must be >= 1")
    # the run first, torch after (gptkit.evaluation, the device, the model): a run= that is not one is
    # one line in 0.24 s of CPU, not 3.3 s (issue 47 item 12, docs/benchmarks.md)
    find_run_checkpoint(cfg.run)
    from gptkit.evaluation import SCORINGS

    if cfg.tasks is not None:
        return run_tasks(cfg)
    if cfg.get("data") is not None and cfg.data.get("kind") == "prompts":
        return run_prompts(cfg)
    given = [k for k in TASK_ONLY if cfg.get(k) is not None]
    if given:
        raise ConfigError(f"{given[0]}= belongs to tasks=...; without tasks= eval scores a corpus (drop it)")
    if cfg.scoring not in SCORINGS:
        raise ConfigError(f"scoring={cfg.scoring!r} must be one of {', '.join(SCORINGS)}")
    return run_corpus(cfg)


def run_corpus(cfg) -> int:
    from gptkit.errors import ConfigError, GptkitError
    from gptkit.evaluation import evaluate_sequences, lm_eval_documents, scored_text_size, window_starts
    from gptkit.inference.generate import special_token_ids
    from gptkit.runs import load_for_inference, resolve_device
    from gptkit.threads import set_threads

    set_threads(cfg.threads, "threads", warn=resolve_device(cfg.device) == "cpu")
    r = load_for_inference(cfg.run, cfg.device, cfg.dtype, quantize=cfg.quantize)
    max_len = r.model_cfg.max_seq_len
    # the windows the run trained and validated on
    trained = (r.config.get("trainer") or {}).get("seq_len")
    # 0 is refused
    seq_len = int(cfg.seq_len if cfg.seq_len is not None else (trained or max_len))
    if not 1 <= seq_len <= max_len:
        raise ConfigError(f"seq_len={seq_len} must be in [1, model.max_seq_len={max_len}]")
    # stride=0 is refused, not 'the default'
    stride = int(cfg.stride if cfg.stride is not None else seq_len)
    if not 1 <= stride <= seq_len:
        raise ConfigError(f"stride={stride} must be in [1, seq_len={seq_len}]")
    if cfg.pack not in (None, "stream", "documents"):
        raise ConfigError(f"pack={cfg.pack!r} must be stream or documents (or null: the run's data.pack)")
    tokens, source, corpus_eos = corpus_tokens(cfg, r)
    lm_eval_scoring = cfg.scoring == "lm-eval"
    eos_id = None if lm_eval_scoring else pack_eos_id(cfg, r, corpus_eos, source)
    if len(tokens) < 2:
        raise GptkitError(f"{source} has {len(tokens)} token(s); evaluation needs at least 2")
    if int(tokens.max()) >= r.model_cfg.vocab_size:
        raise GptkitError(
            f"{source} holds token id {int(tokens.max())} but model.vocab_size="
            f"{r.model_cfg.vocab_size}; evaluate with the run's own tokenizer"
        )
    # each document alone, a BOS (else the EOS) first, no EOS scored
    if lm_eval_scoring:
        bos, eos = special_token_ids(r.tokenizer, r.config)
        prefix = bos if bos is not None else eos
        if prefix is None:
            raise ConfigError(
                "scoring=lm-eval puts a BOS first (the EOS when there is no BOS, as lm-eval "
                "does) and the run's tokenizer has neither; use scoring=gptkit"
            )
        sequences = lm_eval_documents(tokens, corpus_eos, prefix)
    else:
        sequences = [tokens]
    n_windows = sum(len(window_starts(len(s), seq_len, stride)) for s in sequences)
    n_windows = min(n_windows, int(cfg.max_windows)) if cfg.max_windows else n_windows
    bs = int(cfg.batch_size)
    if cfg.progress:
        from rich.console import Console
        from rich.progress import Progress

        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(f"eval {source}", total=n_windows)
            res = evaluate_sequences(
                r.model,
                sequences,
                seq_len,
                stride,
                bs,
                cfg.max_windows,
                lambda n: bar.advance(task, n),
                eos_id=eos_id,
                align_last=lm_eval_scoring,
            )
    else:
        res = evaluate_sequences(
            r.model,
            sequences,
            seq_len,
            stride,
            bs,
            cfg.max_windows,
            eos_id=eos_id,
            align_last=lm_eval_scoring,
        )
    n_bytes = n_chars = 0
    for seq, last in zip(sequences, res.pop("last_targets")):
        b, c = scored_text_size(r.tokenizer, seq, last)
        n_bytes, n_chars = n_bytes + b, n_chars + c
    bits = res["nll_sum"] / math.log(2)
    res.update(
        {
            "run": str(r.dir),
            "checkpoint": str(r.checkpoint),
            "data": source,
            "corpus_tokens": len(tokens),
            "bytes": n_bytes,
            "chars": n_chars,
            "bits_per_byte": bits / max(n_bytes, 1),
            "bits_per_char": bits / max(n_chars, 1),
            "dtype": str(cfg.dtype),
            "scoring": str(cfg.scoring),
        }
    )
    if lm_eval_scoring:
        res["documents_scored"] = len(sequences)
    if cfg.format == "json":
        print(json.dumps(res, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{r.dir.name} on {source}")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("loss (nats/token)", f"{res['loss']:.4f}")
    t.add_row("perplexity", f"{res['perplexity']:.3f}")
    t.add_row("bits per token", f"{res['bits_per_token']:.4f}")
    t.add_row("bits per byte", f"{res['bits_per_byte']:.4f}")
    t.add_row("bits per character", f"{res['bits_per_char']:.4f}")
    t.add_section()
    t.add_row("tokens scored", f"{res['tokens_scored']:,} of {len(tokens):,}")
    t.add_row("bytes / characters scored", f"{n_bytes:,} / {n_chars:,}")
    t.add_row(
        "windows (seq_len, stride)",
        f"{res['windows']:,} ({seq_len}, {stride})"
        + (", attention within documents" if res["documents"] else ""),
    )
    t.add_row(
        "scoring",
        "lm-eval: each document alone, BOS first, no EOS"
        if lm_eval_scoring
        else "gptkit: one stream, EOS after each document scored",
    )
    t.add_row("time", f"{res['seconds']:.2f} s ({res['tokens_per_s']:,.0f} tokens/s)")
    Console().print(t)
    return 0


def run_tasks(cfg) -> int:
    """tasks=...: lm-eval tasks through gptkit's LM adapter; a table, and the results as JSON files."""
    from gptkit.errors import ConfigError
    from gptkit.evaluation import task_results
    from gptkit.evaluation import tasks as T
    from gptkit.runs import load_for_inference, resolve_device
    from gptkit.threads import set_threads

    # before anything is loaded: one line naming the install
    T.require_lm_eval()
    given = [k for k in (*CORPUS_ONLY, "data") if cfg.get(k) is not None]
    if cfg.scoring != "gptkit":
        given.append("scoring")
    if given:
        raise ConfigError(
            f"{given[0]}= belongs to the corpus evaluation (loss, bits per byte); tasks= runs "
            f"lm-eval tasks: drop one of them"
        )
    limit = T.check_limit(cfg.limit)
    task_results.check_out(cfg.out)
    n_samples, ks = None, None
    if cfg.samples is not None or cfg.k is not None:
        from gptkit.evaluation.sampled import check_ks, check_sampling

        n_samples, ks = check_ks(cfg.k, cfg.samples)
        check_sampling(cfg.temperature, cfg.top_p)
    entries = T.parse_tasks(cfg.tasks)
    # reading a task YAML runs the Python its !function tags name: said first
    for line in T.code_notices(entries):
        print(line, file=sys.stderr)
    # local YAMLs are read (and their errors said) before the model loads
    specs = T.find_tasks(entries)
    # a Hub that cannot serve the data sets: one line now, not lm-eval's retries after the registry's index
    T.check_hub(specs)
    T.quiet_lm_eval(progress=bool(cfg.progress))
    from gptkit.evaluation.lm_eval_adapter import GptkitLM

    manager = T.task_manager(specs)
    T.check_names(specs.names, manager)
    task_dict = T.load_tasks(specs, manager)
    T.check_fewshot(T.leaf_tasks(task_dict), cfg.num_fewshot)
    samples, dropped = None, {}
    if cfg.decontaminate is not None:
        from gptkit.evaluation.contamination import read_report

        flagged = read_report(cfg.decontaminate)
        samples, dropped = T.kept_documents(T.leaf_tasks(task_dict), flagged, limit, str(cfg.decontaminate))
    set_threads(cfg.threads, "threads", warn=resolve_device(cfg.device) == "cpu")
    r = load_for_inference(cfg.run, cfg.device, cfg.dtype, quantize=cfg.quantize)
    lm = GptkitLM(r.model, r.tokenizer, r.config, batch_size=int(cfg.batch_size))
    # what the run's tokenizer cannot serve is skipped, and said; the rest is scored
    skipped = T.unscorable(T.leaf_tasks(task_dict), lm)
    specs = T.skip_tasks(specs, skipped)
    for name, why in skipped.items():
        print(T.skip_notice(name, why), file=sys.stderr)
    for name, (gone, of) in dropped.items():
        if name not in skipped:
            print(f"decontaminate: task {name}: {gone} of {of} item(s) left out (flagged)", file=sys.stderr)
    if samples is not None:
        # lm-eval takes samples= or limit=, not both (kept_documents applied the limit)
        samples = {k: v for k, v in samples.items() if k not in skipped} or None
    if n_samples is not None:
        return run_sampled(cfg, r, lm, T.leaf_tasks(task_dict), skipped, n_samples, ks, limit, samples)
    t0 = time.perf_counter()
    results = T.run_tasks(
        lm, specs, manager, num_fewshot=cfg.num_fewshot, limit=None if samples else limit, samples=samples
    )
    seconds = time.perf_counter() - t0
    rows = task_results.result_rows(results)
    written = task_results.write_results(
        results, rows, r, lm.stats, cfg.out, limit=limit, seconds=seconds, skipped=skipped
    )
    n_requests = sum(lm.stats.requests.values())
    if lm.stats.truncated:
        print(
            f"note: {lm.stats.truncated} request(s) were longer than model.max_seq_len="
            f"{r.model_cfg.max_seq_len} tokens and were cut from the left, as lm-eval does",
            file=sys.stderr,
        )
    if cfg.format == "json":
        print(
            json.dumps(
                {
                    "run": str(r.dir),
                    "checkpoint": str(r.checkpoint),
                    "rows": rows,
                    "files": [str(f) for f in written],
                    "requests": dict(lm.stats.requests),
                    "truncated": lm.stats.truncated,
                    "seconds": seconds,
                    "skipped": skipped,
                    "decontaminated": {k: {"dropped": a, "of": b} for k, (a, b) in dropped.items()},
                },
                indent=2,
            )
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{r.dir.name}: lm-eval tasks" + (f" (limit={cfg.limit})" if limit is not None else ""))
    for name, justify in (
        ("task", "left"),
        ("metric", "left"),
        ("value", "right"),
        ("stderr", "right"),
        ("n", "right"),
    ):
        t.add_column(name, justify=justify)
    for row in rows:
        value = row["value"]
        t.add_row(
            row["task"],
            row["metric"],
            f"{value:.4f}" if abs(value) < 1e5 else f"{value:.4g}",
            "" if row["stderr"] is None else f"± {row['stderr']:.4f}",
            str(row["n"] or ""),
        )
    Console().print(t)
    print(
        f"{n_requests:,} requests in {seconds:.1f} s ({lm.stats.seconds:.1f} s in the model, "
        f"{n_requests / max(lm.stats.seconds, 1e-9):,.0f} requests/s); results: "
        f"{', '.join(str(f) for f in written)}",
        file=sys.stderr,
    )
    return 0


def run_sampled(cfg, r, lm, tasks: dict, skipped: dict, n: int, ks: list[int], limit, samples) -> int:
    """samples=n: pass@k and maj@k of every generation task (gptkit.evaluation.sampled); the other tasks are
    skipped and said."""
    from gptkit.evaluation import sampled as S
    from gptkit.evaluation import task_results
    from gptkit.evaluation import tasks as T

    others = {name: S.not_sampled(task) for name, task in tasks.items() if name not in skipped}
    others = {name: why for name, why in others.items() if why}
    todo = {k: v for k, v in tasks.items() if k not in skipped and k not in others}
    if not todo:
        raise T.nothing_to_score({**skipped, **others})
    for name, why in others.items():
        print(T.skip_notice(name, why), file=sys.stderr)
    skipped.update(others)
    t0 = time.perf_counter()
    rows, per_task = [], {}
    for name, task in todo.items():
        if cfg.num_fewshot is not None:
            task.set_config(key="num_fewshot", value=int(cfg.num_fewshot))
        task.set_fewshot_seed(seed=lm.seed)
        got, items = S.score_task(
            lm,
            name,
            task,
            n,
            ks,
            temperature=float(cfg.temperature),
            top_p=float(cfg.top_p),
            seed=lm.seed,
            limit=limit,
            indices=None if samples is None else samples[name],
        )
        rows += got
        per_task[name] = {
            "samples": n,
            "k": ks,
            "temperature": float(cfg.temperature),
            "top_p": float(cfg.top_p),
            "seed": lm.seed,
            "items": items,
        }
    seconds = time.perf_counter() - t0
    written = task_results.write_results(
        {"results": per_task}, rows, r, lm.stats, cfg.out, limit=limit, seconds=seconds, skipped=skipped
    )
    if cfg.format == "json":
        print(
            json.dumps(
                {
                    "run": str(r.dir),
                    "rows": rows,
                    "files": [str(f) for f in written],
                    "seconds": seconds,
                    "skipped": skipped,
                },
                indent=2,
            )
        )
        return 0
    sampled_table(f"{r.dir.name}: {n} samples per item", "task", cfg, rows)
    print(
        f"{sum(lm.stats.requests.values()):,} samples in {seconds:.1f} s; results: "
        f"{', '.join(str(f) for f in written)}",
        file=sys.stderr,
    )
    return 0


def sampled_table(title: str, first: str, cfg, rows: list[dict]) -> None:
    """The terminal table of a sampled evaluation's rows (pass@k, maj@k per task or checker)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{title} (temperature {cfg.temperature}, top_p {cfg.top_p})")
    for name in (first, "metric", "value", "stderr", "n"):
        t.add_column(name, justify="left" if name in (first, "metric") else "right")
    for row in rows:
        stderr = "" if row["stderr"] is None else f"± {row['stderr']:.4f}"
        t.add_row(row["task"], row["metric"], f"{row['value']:.4f}", stderr, str(row["n"]))
    Console().print(t)


def run_prompts(cfg) -> int:
    """data=prompts samples=n: pass@k and maj@k of each checker of rewards= over n sampled answers of every
    prompt (gptkit's own answer-checked prompts, as GRPO's validation scores them: the same SampledSums)."""
    from gptkit.data import prepare
    from gptkit.errors import ConfigError, GptkitError
    from gptkit.evaluation import sampled as S
    from gptkit.inference.rollouts import RolloutOptions, sample_groups
    from gptkit.runs import TOKENIZER_FILE, load_for_inference, resolve_device
    from gptkit.threads import set_threads
    from gptkit.training.rewards import CHECKERS, load_rewards, parse_rewards

    if cfg.samples is None:
        raise ConfigError(
            "data=prompts is scored by sampling its answers: give samples=n (and rewards=[exact] or other "
            "checkers); eval scores windows of a text corpus otherwise"
        )
    n, ks = S.check_ks(cfg.k, cfg.samples)
    S.check_sampling(cfg.temperature, cfg.top_p)
    rewards = parse_rewards(cfg.rewards if cfg.rewards is not None else ["exact"])
    if not any(r.checker for r in rewards.rewards):
        raise ConfigError(
            f"rewards={list(cfg.rewards)}: pass@k and maj@k need a checker ({', '.join(CHECKERS)})"
        )
    max_new = cfg.max_new_tokens
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise ConfigError(f"max_new_tokens={max_new!r} must be an integer >= 1")
    set_threads(cfg.threads, "threads", warn=resolve_device(cfg.device) == "cpu")
    r = load_for_inference(cfg.run, cfg.device, cfg.dtype, quantize=cfg.quantize)
    tok_cfg = {
        "kind": "file",
        "path": str(r.dir / TOKENIZER_FILE),
        "eos_token": (r.config.get("tokenizer") or {}).get("eos_token"),
    }
    p = prepare(cfg.data, tok_cfg, progress=False)
    if p.vocab_size > r.model_cfg.vocab_size:
        raise GptkitError(
            f"the prompts' template adds tokens the run's model has no row for (vocabulary {p.vocab_size} "
            f"> model.vocab_size={r.model_cfg.vocab_size}); use the run's own template (data.template=auto)"
        )
    load_rewards(rewards)
    tok = p.manifest["tokenizer"]
    stops = tuple(i for i in (tok.get("end_of_turn_id"), tok.get("eos_id")) if i is not None)
    opts = RolloutOptions(max_new, float(cfg.temperature), None, float(cfg.top_p), stops)
    tokenizer = p.tokenizer()
    sums = S.SampledSums(rewards.rewards, ks, keep=True)
    max_len = r.model_cfg.max_seq_len
    t0, done, items = time.perf_counter(), 0, []
    split_rows = [(split, i) for split in (p.train, p.val) for i in range(split.n)]
    for i, (split, j) in enumerate(split_rows):
        ids, row, where = split.ids(j), split.rows[j], split.where[j]
        if len(ids) >= max_len:
            raise GptkitError(f"{where}: the prompt makes {len(ids)} tokens, model.max_seq_len={max_len}")
        keys = [S.item_key(S.SEED, "prompts", i, s) for s in range(n)]
        (group,) = sample_groups(r.model, [ids], [keys], opts, [min(max_new, max_len - len(ids))])
        texts = [
            tokenizer.decode(c.tokens[:-1] if c.tokens and c.tokens[-1] in stops else c.tokens) for c in group
        ]
        seqs = [ids + c.tokens for c in group]
        given = iter(rewards.model_scores(seqs, next(r.model.parameters()).device, tokenizer))
        prompt = row.get(cfg.data.get("prompt_field", "prompt"))
        prompt = prompt if isinstance(prompt, str) else row.get(cfg.data.get("messages_field", "messages"))
        with rewards.guard():
            scores = [rewards.score(prompt, t, row, where, next(given)) for t in texts]
        sums.add([scores], [texts])
        items.append({"where": where, "texts": texts, "scores": scores})
        done += n
    seconds = time.perf_counter() - t0
    source = p.manifest["source"]["description"] or p.dir.name
    rows = []
    for key, values in sums.items.items():
        mean, stderr = S.mean_stderr(values)
        metric, checker = key.split("/", 1)
        rows.append(
            {
                "task": source,
                "metric": f"{metric} ({checker})",
                "value": mean,
                "stderr": stderr,
                "n": len(values),
            }
        )
    out = {
        "run": str(r.dir),
        "data": source,
        "samples": n,
        "k": ks,
        "temperature": float(cfg.temperature),
        "top_p": float(cfg.top_p),
        "rewards": rewards.names,
        "rows": rows,
        "seconds": seconds,
        "items": items,
    }
    if cfg.format == "json":
        print(json.dumps(out, indent=2))
        return 0
    sampled_table(f"{r.dir.name}: {n} samples per prompt", "prompts", cfg, rows)
    print(f"{done:,} samples in {seconds:.1f} s", file=sys.stderr)
    return 0
