"""Sampled evaluation: pass@k and maj@k of n sampled completions per item (`gptkit eval samples=n k=[...]`,
and objective=grpo's validation with grpo.val_samples).

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"):
of n samples of an item, c correct, the chance that at least one of k drawn without replacement is correct,

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

(the product form: no huge binomials; 1 when n - c < k), averaged over the items.

maj@k (majority voting, "self-consistency"): the answers extracted from the item's first k samples are
counted, the most frequent one is the item's answer and is scored. A tie goes to the answer seen first among
the k samples (so maj@1 is the first sample's score). A sample without an answer (None) does not vote; an
item whose k samples all lack one scores 0.

Each sample is drawn with the rollout sampler's keys (gptkit.inference.rollouts: the noise of a completion is
a pure function of its key), sample_key(seed, task, item, r): a rerun draws the same samples, whatever the
batch, the order or the other tasks.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from typing import Any, Hashable, Sequence

from gptkit.errors import ConfigError

# the seed of the sample keys (GptkitLM's, lm-eval's default random seed)
SEED = 1234


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one item with n samples of which c are correct (module docstring)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority(answers: Sequence[Hashable | None]) -> Hashable | None:
    """The most frequent answer (ties: the one seen first; None does not vote; None when none votes)."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    best = max(votes.values())
    return next(a for a in answers if a is not None and votes[a] == best)


def check_ks(ks: Any, n: Any, n_key: str = "samples", k_key: str = "k") -> tuple[int, list[int]]:
    """(samples, the k of pass@k and maj@k) checked: n >= 1 samples, every k in 1..n (k=null: 1 and n)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{n_key}={n!r} must be an integer >= 1 (completions sampled per item)")
    if ks is None:
        return n, sorted({1, n})
    # k=4 or k=[1,4] (a Hydra list)
    values = list(ks) if hasattr(ks, "__iter__") and not isinstance(ks, str) else [ks]
    out = []
    for k in values:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"{k_key}={k!r} must be an integer >= 1 (the k of pass@k and maj@k)")
        if k > n:
            raise ConfigError(
                f"{k_key}={k} is larger than the samples per item ({n_key}={n}): pass@{k} needs at least "
                f"{k} samples"
            )
        out.append(int(k))
    if not out:
        raise ConfigError(f"{k_key}=[] names no k; give at least one ({k_key}=[1,{n}])")
    return n, sorted(set(out))


def check_sampling(temperature: Any, top_p: Any) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ConfigError(f"temperature={temperature!r} must be a number >= 0 (0: greedy)")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ConfigError(f"top_p={top_p!r} must be in (0, 1] (1: off)")


def item_key(seed: int, task: str, item: int, sample: int) -> int:
    """The key of sample r of an item of a task (the rollout sampler's sample_key)."""
    from gptkit.inference.rollouts import sample_key

    return sample_key(seed, zlib.crc32(task.encode("utf-8")), item, sample)


def item_figures(correct: Sequence[bool], answers: Sequence[Hashable | None], majority_correct, ks) -> dict:
    """pass@k and maj@k of one item: correct[r] of each sample, answers[r] (the extracted answer, for maj@k),
    majority_correct(answer) -> bool scores a majority answer."""
    n, c = len(correct), sum(bool(x) for x in correct)
    out = {}
    for k in ks:
        out[f"pass@{k}"] = pass_at_k(n, c, k)
        m = majority(answers[:k])
        out[f"maj@{k}"] = float(m is not None and bool(majority_correct(m)))
    return out


class SampledSums:
    """grpo.val_samples > 1 and `eval samples=` on prompts with answers: per checker (a built-in check, its
    reward 1 when right) the sums over the prompts of pass@k (Chen et al.'s unbiased estimator) and, for a
    checker that extracts an answer, maj@k (the majority of the first k samples' answers; ties: the first
    seen), summed over the ranks. keep: each prompt's values kept too (`items`, for standard errors)."""

    def __init__(self, rewards, ks: list[int], keep: bool = False) -> None:
        self.ks, self.keep = ks, keep
        self.items: dict[str, list[float]] = {}
        self.checkers = [(j, r) for j, r in enumerate(rewards) if r.checker]
        self.keys = ["prompts"]
        for _, r in self.checkers:
            self.keys += [f"pass@{k}/{r.name}" for k in ks]
            self.keys += [f"maj@{k}/{r.name}" for k in ks] if r.answers else []
        self.sums = dict.fromkeys(self.keys, 0.0)

    def add(self, scores: list[list[list[float]]], texts: list[list[str]]) -> None:
        """One micro-batch's val prompts: scores[p][i][j] (reward j of sample i of prompt p), texts[p][i]."""
        for group, group_texts in zip(scores, texts):
            self.sums["prompts"] += 1
            for j, r in self.checkers:
                right = [s[j] == 1.0 for s in group]
                answers = [r.answer(t) for t in group_texts] if r.answers else None
                f = item_figures(
                    right,
                    answers or [None] * len(right),
                    lambda a, answers=answers, right=right: right[answers.index(a)],
                    self.ks,
                )
                for key, v in f.items():
                    name = f"{key}/{r.name}"
                    if name in self.sums:
                        self.sums[name] += v
                        if self.keep:
                            self.items.setdefault(name, []).append(v)

    def read(self, strategy, device) -> dict[str, float]:
        """val/pass@k/<checker>, val/maj@k/<checker>: the means over every rank's val prompts; then afresh."""
        import torch

        sums = torch.tensor([self.sums[k] for k in self.keys], dtype=torch.float64, device=device)
        if strategy is not None:
            sums = strategy.reduce(sums, reduce_op="sum")
        values = dict(zip(self.keys, sums.tolist()))
        self.sums = dict.fromkeys(self.keys, 0.0)
        n = values.pop("prompts")
        return {f"val/{k}": v / n for k, v in values.items()} if n else {}


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean and its standard error (sample std / sqrt(n); None for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def _hashable(answer: Any) -> Hashable | None:
    """An extracted answer as a vote: text stripped (an empty one does not vote), else its repr."""
    if answer is None:
        return None
    if isinstance(answer, str):
        return answer.strip() or None
    return answer if isinstance(answer, Hashable) else repr(answer)


def not_sampled(task) -> str | None:
    """Why a task is not scored by samples (None: it is a generation task)."""
    kind = getattr(task, "OUTPUT_TYPE", None)
    if kind != "generate_until":
        return f"is a {kind} task; pass@k and maj@k (samples=) score generation tasks (generate_until)"
    return None


def primary_metric(task) -> str:
    """The metric a sample is judged correct by: the task's first (its value 1: correct)."""
    metrics = [m.get("metric") for m in (task.config.metric_list or []) if isinstance(m, dict)]
    return str(metrics[0]) if metrics and isinstance(metrics[0], str) else "exact_match"


def score_task(
    lm,
    name: str,
    task,
    n: int,
    ks: list[int],
    *,
    temperature: float,
    top_p: float,
    seed: int,
    limit: int | float | None = None,
    indices: list[int] | None = None,
) -> tuple[list[dict], dict]:
    """pass@k and maj@k of one generate_until task: n samples of each evaluated item (its first `limit`, or
    `indices`), each judged by the task's filters and process_results on its primary metric (1: correct);
    the extracted answer (after the filters) is the vote of maj@k. Returns (rows of the results table,
    per item: its samples' texts, answers and correctness)."""
    metric = primary_metric(task)
    if isinstance(limit, float):
        limit = int(math.ceil(len(task.eval_docs) * limit))
    task.build_all_requests(limit=None if indices else limit, samples=indices)
    docs = dict(task.doc_iterator(limit=None if indices else limit, samples=indices))
    first = {}
    for inst in task.instances:
        if inst.doc_id not in first or inst.idx < first[inst.doc_id].idx:
            first[inst.doc_id] = inst
    instances = [first[d] for d in docs]
    texts = [
        lm.sample_until(inst.args, [item_key(seed, name, d, r) for r in range(n)], temperature, top_p)
        for d, inst in zip(docs, instances)
    ]
    # each sample through the task's filters: per filter, per item, per sample its extracted answer
    task._instances = instances
    answers: dict[str, list[list[Any]]] = {}
    for r in range(n):
        for inst, t in zip(instances, texts):
            inst.resps = [t[r]]
        task.apply_filters()
        for key in instances[0].filtered_resps if instances else {}:
            per = answers.setdefault(key, [[] for _ in instances])
            for j, inst in enumerate(instances):
                per[j].append(inst.filtered_resps[key])

    def correct(doc, answer) -> bool:
        value = task.process_results(doc, [answer]).get(metric)
        if value is None:
            raise ConfigError(f"task {name} gives no {metric} for a sample; pass@k needs a 0/1 metric")
        return float(value) == 1.0

    rows, items = [], {}
    for key, per_item in answers.items():
        figures: dict[str, list[float]] = {}
        for j, (d, doc) in enumerate(docs.items()):
            ok = [correct(doc, a) for a in per_item[j]]
            votes = [_hashable(a) for a in per_item[j]]
            by_vote = {v: a for v, a in zip(votes, per_item[j]) if v is not None}
            f = item_figures(ok, votes, lambda v, doc=doc, by_vote=by_vote: correct(doc, by_vote[v]), ks)
            for m, v in f.items():
                figures.setdefault(m, []).append(v)
            items.setdefault(d, {"texts": texts[j]})[key] = {
                "answers": [str(a) for a in per_item[j]],
                "correct": ok,
            }
        for m, values in figures.items():
            mean, stderr = mean_stderr(values)
            label = m if key == "none" else f"{m},{key}"
            rows.append(
                {
                    "task": name,
                    "metric": f"{label} ({metric})",
                    "value": mean,
                    "stderr": stderr,
                    "n": len(values),
                }
            )
    return rows, items
