"""data=mix: a weighted mixture of named sources, each a full data config plus `weight`.

    gptkit train data=mix 'data.sources={web: {kind: files, paths: [web.jsonl], weight: 0.7},
                                         code: {kind: stdlib, weight: 0.3}}'

Each source is prepared and cached on its own, so adding a source re-uses the others' caches. All
sources share one tokenizer: byte and file as configured; char and bpe are built once from all
sources (a bpe on a sample of each source in proportion to its weight, tokenizer.train_chars in all)
and cached by the sources' content, so with those two kinds a changed source set means a new
tokenizer and new shards for every source.

Windows are drawn by a pure function of (seed, micro-step, rank): the micro-step's global batch of
batch_size x world_size windows takes each window's source from a generator seeded with (seed, step)
by the shares (weights normalized), then each source's window starts, distinct, from the same
generator; rank r takes its slice. Resume stays bit-exact and ranks disjoint, as with one source.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import numbers
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.data import build
from gptkit.data.prepared import PreparedData
from gptkit.data.sources import open_corpus
from gptkit.data.windows import check_window, windows
from gptkit.errors import GptkitError
from gptkit.fsio import atomic_write_text
from gptkit.tokenizer import build_tokenizer, tokenizer_settings

SOURCE_KINDS = ("pydoc", "shakespeare", "stdlib", "files", "hub", "prepared", "tokens")
EXAMPLE = (
    "data.sources={web: {kind: files, paths: [web.jsonl], weight: 0.7}, code: {kind: stdlib, weight: 0.3}}"
)


def _plain(cfg: Any) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def mix_sources(d: dict[str, Any]) -> dict[str, tuple[dict[str, Any], float]]:
    """{name: (the source's data settings, weight)}, every problem a one-line GptkitError."""
    sources = d.get("sources")
    if not isinstance(sources, dict) or not sources:
        raise GptkitError(f"data=mix needs named sources, e.g. {EXAMPLE}")
    out = {}
    for name, s in sources.items():
        where = f"data.sources.{name}"
        if not isinstance(s, dict):
            raise GptkitError(
                f"{where} must be a data config with a weight, e.g. {{kind: stdlib, weight: 0.3}}"
            )
        kind = s.get("kind")
        if kind == "mix":
            raise GptkitError(f"{where} is itself a mix; list its sources in data.sources instead")
        if kind not in SOURCE_KINDS:
            raise GptkitError(f"{where}.kind={kind!r}: use one of {', '.join(SOURCE_KINDS)}")
        if "weight" not in s:
            raise GptkitError(f"{where} has no weight; give it one, e.g. {where}.weight=0.3")
        w = s["weight"]
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise GptkitError(f"{where}.weight={w!r} is not a number; give a weight > 0")
        if not math.isfinite(w):
            raise GptkitError(f"{where}.weight={w} is not finite; give a finite weight > 0, e.g. 0.3")
        if not w > 0:
            raise GptkitError(f"{where}.weight={w} must be > 0 (leave the source out to not use it)")
        allowed = {"kind", "weight", *build.DEFAULTS[kind], *build.WINDOW_KEYS, *build.BUILD_KEYS}
        for k in s:
            if k not in allowed:
                close = difflib.get_close_matches(k, sorted(allowed), n=1)
                hint = (
                    f"; did you mean {close[0]}?"
                    if close
                    else f"; a {kind} source has {', '.join(sorted(allowed))}"
                )
                raise GptkitError(f"{where} has an unknown key {k!r}{hint}")
        for k in (*build.WINDOW_KEYS, *build.BUILD_KEYS):
            if k in s and k in d and s[k] != d[k]:
                raise GptkitError(f"{where}.{k} differs from data.{k}; set it once, on the mixture")
        settings = build.data_settings({k: v for k, v in s.items() if k != "weight"})
        out[str(name)] = (settings, float(w))
    return out


@dataclass
class MixedData:
    """Several prepared sources with their shares; what train needs of a PreparedData, for all of them."""

    names: list[str]
    parts: list[PreparedData]
    weights: list[float]
    max_epochs: float
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def shares(self) -> list[float]:
        # divided by the largest first: a sum of weights near the float maximum would overflow to inf
        top = max(self.weights)
        scaled = [w / top for w in self.weights]
        total = sum(scaled)
        return [w / total for w in scaled]

    @property
    def dir(self) -> Path:
        return self.parts[0].dir

    @property
    def tokenizer_path(self) -> Path:
        return self.parts[0].tokenizer_path

    @property
    def vocab_size(self) -> int:
        return self.parts[0].vocab_size

    @property
    def eos_id(self) -> int | None:
        return self.parts[0].eos_id

    @property
    def dtype(self) -> str:
        return self.parts[0].dtype

    def tokenizer(self):
        return self.parts[0].tokenizer()

    def wait_checked(self) -> None:
        for p in self.parts:
            p.wait_checked()

    def describe(self, budget_tokens: int | None) -> list[str]:
        """Per source: its train tokens, its share, and the epochs of it that `budget_tokens` means; a line
        'warning: ...' for each source that would repeat more than max_epochs."""
        lines, warnings = [], []
        for name, p, share in zip(self.names, self.parts, self.shares):
            n = int(p.manifest["splits"]["train"]["tokens"])
            line = f"  {name}: {n:,} train tokens, share {100 * share:.1f}%"
            if budget_tokens:
                epochs = budget_tokens * share / n
                line += f", {epochs:.2f} epochs of it in this run's {budget_tokens:,} tokens"
                if epochs > self.max_epochs:
                    warnings.append(
                        f"warning: data source {name!r} would be repeated {epochs:.1f} times, more than "
                        f"data.max_epochs={self.max_epochs:g}: give it more text, a lower weight, or "
                        f"fewer steps"
                    )
            lines.append(line)
        return lines + warnings


def prepare(
    data_cfg: Any,
    tokenizer_cfg: Any,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    force: bool = False,
):
    """Token shards for (corpus, tokenizer), cached (gptkit.data.build.prepare); for data=mix a MixedData of
    every source's shards."""
    d = _plain(data_cfg)
    if d.get("kind") != "mix":
        return build.prepare(data_cfg, tokenizer_cfg, cache_dir, progress, force)
    for k in d:
        if k not in ("kind", *build.DEFAULTS["mix"], *build.WINDOW_KEYS, *build.BUILD_KEYS):
            raise GptkitError(
                f"data=mix has no key {k!r}: the sources' own settings go in data.sources.<name>"
            )
    sources = mix_sources(d)
    max_epochs = d.get("max_epochs", build.DEFAULTS["mix"]["max_epochs"])
    if isinstance(max_epochs, bool) or not isinstance(max_epochs, numbers.Real) or max_epochs <= 0:
        raise GptkitError(f"data.max_epochs={max_epochs!r} must be a number > 0")
    tok_s = tokenizer_settings(tokenizer_cfg)
    shared = (
        _shared_tokenizer(sources, tok_s, cache_dir, progress) if tok_s["kind"] in ("char", "bpe") else tok_s
    )
    parts = []
    for name, (settings, _) in sources.items():
        build._say(f"data source {name!r}:")
        extra = {k: d[k] for k in build.BUILD_KEYS if k in d}
        parts.append(build.prepare({**settings, **extra}, shared, cache_dir, progress, force))
    names, weights = list(sources), [w for _, w in sources.values()]
    mixed = MixedData(names, parts, weights, float(max_epochs))
    shares = mixed.shares
    first = parts[0].manifest
    mixed.manifest = {
        "format": "gptkit-mixture",
        "source": {
            "kind": "mix",
            "description": "mixture of " + ", ".join(f"{n} ({100 * s:.0f}%)" for n, s in zip(names, shares)),
        },
        "tokenizer": first["tokenizer"],
        "dtype": first["dtype"],
        "splits": {
            s: {"tokens": sum(int(p.manifest["splits"][s]["tokens"]) for p in parts)}
            for s in ("train", "val")
        },
        "sources": {
            n: {
                "weight": w,
                "share": s,
                "dir": str(p.dir),
                "checksum": p.manifest["checksum"],
                "description": p.manifest["source"]["description"],
                "splits": p.manifest["splits"],
            }
            for n, w, s, p in zip(names, weights, shares, parts)
        },
    }
    for p in parts[1:]:
        if p.manifest["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]:
            raise GptkitError(
                f"the sources of data=mix were written by different tokenizers ({parts[0].dir} and "
                f"{p.dir}); prepare them with one tokenizer"
            )
    return mixed


def _shared_tokenizer(
    sources: dict[str, tuple[dict[str, Any], float]],
    tok_s: dict[str, Any],
    cache_dir: str | Path | None,
    progress: bool,
) -> dict[str, Any]:
    """A char or bpe tokenizer built once from all sources, cached by their content: the settings of a
    tokenizer=file that names it."""
    corpora = {}
    for name, (settings, _) in sources.items():
        if settings["kind"] == "prepared":
            raise GptkitError(
                f"data.sources.{name} is a prepared folder, which has its tokenizer already: with "
                f"it use that tokenizer (tokenizer=file tokenizer.path=<folder>/tokenizer.json)"
            )
        corpora[name] = open_corpus(settings)
    body = {
        "tokenizer": tok_s,
        "sources": {n: [sources[n][0], sources[n][1], c.sha256()] for n, c in corpora.items()},
    }
    key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    path = build.cache_root(cache_dir) / "tokenizers" / f"mix-{tok_s['kind']}-{key[:16]}.json"
    if not path.is_file():
        total = sum(w for _, w in sources.values())
        if tok_s["kind"] == "bpe":
            chars = int(tok_s["train_chars"])
            samples = [
                (build.training_sample(c, max(1, int(chars * sources[n][1] / total))), n)
                for n, c in corpora.items()
            ]
            for (_, what), n in samples:
                build._say(f"  {n}: {what}")
            build._say(
                f"training byte-level BPE {tok_s['vocab_size']} on all sources of the mixture "
                f"(tokenizer.train_chars={chars:,}, by weight)"
            )
            tok = build_tokenizer(
                tok_s, texts=lambda: (t for (texts, _), _ in samples for t in texts()), progress=progress
            )
        else:
            tok = build_tokenizer(
                tok_s,
                texts=lambda: (t for c in corpora.values() for t, _ in c.all_parts()),
                progress=progress,
            )
        atomic_write_text(path, tok.to_str())
    return {"kind": "file", "path": str(path), "eos_token": tok_s["eos_token"]}


class MixtureSampler:
    """Training windows from several sources by their shares; batch(step, rank, world_size) is pure."""

    def __init__(
        self,
        tokens: list[np.ndarray],
        shares: list[float],
        batch_size: int,
        seq_len: int,
        seed: int,
        eos_id: int | None = None,
        *,
        vocab_size: int | None = None,
    ) -> None:
        for t in tokens:
            check_window(len(t), seq_len, "train")
        self.tokens, self.shares = tokens, np.asarray(shares, dtype=np.float64)
        self.batch_size, self.seq_len, self.seed = int(batch_size), int(seq_len), int(seed)
        self.eos_id, self.vocab_size = eos_id, vocab_size
        self.n_starts = [len(t) - seq_len for t in tokens]

    def _rng(self, step: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, int(step)])))

    def sources(self, step: int, world_size: int = 1) -> np.ndarray:
        """The source of each window of micro-step `step`'s global batch: [batch_size * world_size]."""
        return self._rng(step).choice(len(self.tokens), size=self.batch_size * world_size, p=self.shares)

    def starts(self, step: int, world_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(sources, starts) of the global batch: [batch_size * world_size] each; distinct per source."""
        rng = self._rng(step)
        n = self.batch_size * world_size
        src = rng.choice(len(self.tokens), size=n, p=self.shares)  # [n]
        starts = np.zeros(n, dtype=np.int64)
        for s in range(len(self.tokens)):
            idx = np.flatnonzero(src == s)
            if len(idx) > self.n_starts[s]:
                raise GptkitError(
                    f"a data source has only {self.n_starts[s]} distinct windows, fewer than the "
                    f"{len(idx)} a batch draws from it; give it more text or use a smaller batch"
                )
            starts[idx] = rng.choice(self.n_starts[s], size=len(idx), replace=False)
        return src, starts

    def batch(self, step: int, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        src, starts = self.starts(step, world_size)
        mine = slice(rank * self.batch_size, (rank + 1) * self.batch_size)
        src, starts = src[mine], starts[mine]  # [batch_size] each
        out = None
        for s in np.unique(src):
            idx = np.flatnonzero(src == s)
            got = windows(self.tokens[s], starts[idx], self.seq_len, self.eos_id, vocab_size=self.vocab_size)
            if out is None:
                out = [t.new_zeros((self.batch_size, *t.shape[1:])) for t in got]
            for o, t in zip(out, got):
                o[idx] = t
        return tuple(out)

    def consumed(self, micro_steps: int, world_size: int, cache: dict | None = None) -> np.ndarray:
        """Windows drawn from each source in micro-steps [0, micro_steps) of all ranks: [n sources]."""
        cache = cache if cache is not None else {}
        done, counts = cache.get("at", (0, np.zeros(len(self.tokens), dtype=np.int64)))
        if done > micro_steps:
            done, counts = 0, np.zeros(len(self.tokens), dtype=np.int64)
        counts = counts.copy()
        for m in range(done, micro_steps):
            counts += np.bincount(self.sources(m, world_size), minlength=len(self.tokens))
        cache["at"] = (micro_steps, counts)
        return counts


def announce(mixed: MixedData, budget_tokens: int | None) -> None:
    """Print the mixture's sources at start-up (stderr)."""
    print(f"data mixture ({len(mixed.names)} sources):", file=sys.stderr)
    for line in mixed.describe(budget_tokens):
        print(line, file=sys.stderr)
