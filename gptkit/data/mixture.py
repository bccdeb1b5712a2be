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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gptkit.data.build import training_sample
from gptkit.data.console import say
from gptkit.data.face import BuildOptions, Feed, Origin, Prepared
from gptkit.data.files import expand_paths
from gptkit.data.prepared import PreparedData
from gptkit.data.settings import BUILD_KEYS, SPECIAL_TEXT_KEY, WINDOW_KEYS, defaults, settings
from gptkit.data.sources import Corpus
from gptkit.data.windows import TaggedWindows, check_pack, check_window, windows
from gptkit.errors import GptkitError
from gptkit.fsio import atomic_write_text
from gptkit.tokenizer import TokenizerSpec, build_tokenizer, tokenizer_spec

EXAMPLE = (
    "data.sources={web: {kind: files, paths: [web.jsonl], weight: 0.7}, code: {kind: stdlib, weight: 0.3}}"
)


def mix_sources(d: dict[str, Any], mixable: tuple[str, ...]) -> dict[str, tuple[dict[str, Any], float]]:
    """{name: (the source's complete data settings, weight)}, every problem a one-line GptkitError; a source
    is of one of the `mixable` kinds (a token stream)."""
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
        if kind not in mixable:
            raise GptkitError(f"{where}.kind={kind!r}: use one of {', '.join(mixable)}")
        if "weight" not in s:
            raise GptkitError(f"{where} has no weight; give it one, e.g. {where}.weight=0.3")
        w = s["weight"]
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise GptkitError(f"{where}.weight={w!r} is not a number; give a weight > 0")
        if not math.isfinite(w):
            raise GptkitError(f"{where}.weight={w} is not finite; give a finite weight > 0, e.g. 0.3")
        if not w > 0:
            raise GptkitError(f"{where}.weight={w} must be > 0 (leave the source out to not use it)")
        allowed = {"kind", "weight", *defaults(kind), *WINDOW_KEYS, *BUILD_KEYS}
        for k in s:
            if k not in allowed:
                close = difflib.get_close_matches(k, sorted(allowed), n=1)
                hint = (
                    f"; did you mean {close[0]}?"
                    if close
                    else f"; a {kind} source has {', '.join(sorted(allowed))}"
                )
                raise GptkitError(f"{where} has an unknown key {k!r}{hint}")
        for k in (*WINDOW_KEYS, *BUILD_KEYS):
            if k in s and k in d and s[k] != d[k]:
                raise GptkitError(f"{where}.{k} differs from data.{k}; set it once, on the mixture")
        out[str(name)] = (settings({k: v for k, v in s.items() if k != "weight"}), float(w))
    return out


def shares_of(weights: list[float]) -> list[float]:
    """Finite weights > 0 as shares summing to 1, divided by the largest first: a sum of weights near the
    float maximum would overflow to inf."""
    top = max(weights)
    scaled = [w / top for w in weights]
    total = sum(scaled)
    return [w / total for w in scaled]


@dataclass
class MixedData(Prepared):
    """Several prepared token-shard sources with their shares: a Prepared made of parts (one tokenizer)."""

    names: list[str]
    parts: list[PreparedData]
    weights: list[float]
    max_epochs: float
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def shares(self) -> list[float]:
        return shares_of(self.weights)

    @property
    def dir(self) -> Path:
        return self.parts[0].dir

    @property
    def tokenizer_path(self) -> Path:
        return self.parts[0].tokenizer_path

    @property
    def dtype(self) -> str:
        return self.parts[0].dtype

    def wait_checked(self) -> None:
        for p in self.parts:
            p.wait_checked()

    def train_tokens(self) -> np.ndarray:
        """Every source's train tokens, one after another (documents never span two sources)."""
        return np.concatenate([p.train_tokens() for p in self.parts])

    def val_tokens(self) -> np.ndarray:
        """Every source's val tokens, one after another."""
        return np.concatenate([p.val_tokens() for p in self.parts])

    def counts(self) -> str:
        return f"{len(self.parts)} sources, " + super().counts()

    def table(self) -> list[tuple[str, str]]:
        rows = super().table()
        parts = [
            (
                f"  {name} ({100 * src['share']:.0f}%)",
                f"{src['splits']['train']['tokens']:,} train tokens, {src['dir']}",
            )
            for name, src in self.manifest["sources"].items()
        ]
        return rows[:1] + parts + rows[1:2] + [("dtype", self.dtype)] + rows[2:]

    def sources_lines(self, budget_tokens: int | None) -> list[str]:
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

    def connect(
        self, batch_size: int, seq_len: int, seed: int, val_windows: int | None, pack: str | None = None
    ) -> MixFeed:
        """Windows of every source by its share (MixtureSampler); the val windows of every source (each
        source's share of val_windows), tagged with their index and named by source."""
        import torch
        from torch.utils.data import ConcatDataset

        pack = pack or "stream"
        check_pack(pack, self.eos_id)
        eos = self.eos_id if pack == "documents" else None
        sampler = MixtureSampler(
            [p.train_tokens() for p in self.parts],
            self.shares,
            batch_size,
            seq_len,
            seed,
            eos,
            vocab_size=self.vocab_size,
        )
        each = None if val_windows is None else max(1, int(val_windows) // len(self.parts))
        sets = [p.val_windows(seq_len, each, eos) for p in self.parts]
        sizes = torch.tensor([len(v) for v in sets])
        # [n_val_windows] the source of each val window
        source_of = torch.repeat_interleave(torch.arange(len(sets)), sizes)

        def tracer(step: int, rank: int, world_size: int, chars: int) -> list[Origin]:
            src, starts = sampler.mine(step, rank, world_size)
            return [
                self.parts[s].origins().origin(i, self.names[s], int(start), seq_len, chars)
                for i, (s, start) in enumerate(zip(src, starts))
            ]

        return MixFeed(
            sampler,
            TaggedWindows(ConcatDataset(sets)),
            val_sources=(list(self.names), source_of),
            tracer=tracer,
            mixed=self,
        )


@dataclass
class MixFeed(Feed):
    """A mixture's feed: its sources announced at start-up, the windows drawn from each counted."""

    mixed: MixedData | None = None
    _consumed: dict = field(default_factory=dict)

    def announce(self, budget_tokens: int | None) -> list[str]:
        return [f"data mixture ({len(self.mixed.names)} sources):", *self.mixed.sources_lines(budget_tokens)]

    def consumed(self, micro_steps: int, world_size: int) -> dict[str, int]:
        counts = self.sampler.consumed(micro_steps, world_size, self._consumed)
        return {name: int(c) for name, c in zip(self.mixed.names, counts)}


def prepare_mix(
    s: dict[str, Any],
    tok: TokenizerSpec,
    opts: BuildOptions,
    *,
    prepare_source: Callable[[dict[str, Any], TokenizerSpec, BuildOptions], Prepared],
    open_source: Callable[[dict[str, Any]], Corpus | None],
    mixable: tuple[str, ...],
) -> MixedData:
    """data=mix: every source prepared by `prepare_source` (its kind's own prepare, one of `mixable`), with
    one tokenizer (char and bpe: built once from all sources' text, which `open_source` opens), as a
    MixedData."""
    allowed = ("kind", *defaults("mix"), *WINDOW_KEYS, *BUILD_KEYS)
    for k in s:
        if k not in allowed:
            raise GptkitError(
                f"data=mix has no key {k!r}: the sources' own settings go in data.sources.<name>"
            )
    sources = mix_sources(s, mixable)
    max_epochs = s["max_epochs"]
    if isinstance(max_epochs, bool) or not isinstance(max_epochs, numbers.Real) or max_epochs <= 0:
        raise GptkitError(f"data.max_epochs={max_epochs!r} must be a number > 0")
    # every source's files exist before any source is built: a missing file is one line naming its source
    # (data.sources.<name>.paths), not a line after the sources before it were prepared
    for name, (source, _) in sources.items():
        if "paths" in source and not source["paths"]:
            raise GptkitError(
                f"data.sources.{name} (kind {source['kind']}) needs its files: "
                f"data.sources.{name}.paths=[file,...] (files or globs)"
            )
        for key in ("paths", "val_paths"):
            if source.get(key):
                expand_paths(source[key], f"data.sources.{name}.{key}", quiet=True)
    shared = _shared_tokenizer(sources, tok, opts, open_source) if tok.built_from_corpus else tok
    parts = []
    for name, (source, _) in sources.items():
        say(f"data source {name!r}:")
        extra = {k: s[k] for k in BUILD_KEYS if k in s}
        parts.append(prepare_source({**source, **extra}, shared, opts))
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
    tok: TokenizerSpec,
    opts: BuildOptions,
    open_source: Callable[[dict[str, Any]], Corpus | None],
) -> TokenizerSpec:
    """A char or bpe tokenizer built once from all sources, cached by their content: the spec of a
    tokenizer=file that names it."""
    corpora = {}
    for name, (source, _) in sources.items():
        corpus = open_source(source)
        # token ids made elsewhere (a prepared folder, token files): they come with their tokenizer
        if corpus is None:
            raise GptkitError(
                f"data.sources.{name} ({source['kind']}) holds token ids, not text, so a {tok.kind} "
                "tokenizer cannot be trained on it: use the tokenizer that made them (tokenizer=file "
                "tokenizer.path=<its tokenizer.json>)"
            )
        corpora[name] = corpus
    # special_tokens_in_content changes no tokenizer: no part of its key (nor did it exist before)
    body = {
        "tokenizer": tok.settings,
        "sources": {
            n: [{k: v for k, v in sources[n][0].items() if k != SPECIAL_TEXT_KEY}, sources[n][1], c.sha256()]
            for n, c in corpora.items()
        },
    }
    key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    path = opts.cache / "tokenizers" / f"mix-{tok.kind}-{key[:16]}.json"
    if not path.is_file():
        share = dict(zip(sources, shares_of([w for _, w in sources.values()])))
        if tok.kind == "bpe":
            chars = int(tok.get("train_chars"))
            samples = [(training_sample(c, max(1, int(chars * share[n]))), n) for n, c in corpora.items()]
            for (_, what), n in samples:
                say(f"  {n}: {what}")
            say(
                f"training byte-level BPE {tok.get('vocab_size')} on all sources of the mixture "
                f"(tokenizer.train_chars={chars:,}, by weight)"
            )
            built = build_tokenizer(
                tok, texts=lambda: (t for (texts, _), _ in samples for t in texts()), progress=opts.progress
            )
        else:
            built = build_tokenizer(
                tok,
                texts=lambda: (t for c in corpora.values() for t, _ in c.all_parts()),
                progress=opts.progress,
            )
        atomic_write_text(path, built.to_str())
    return tokenizer_spec({"kind": "file", "path": str(path), "eos_token": tok.eos_token})


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

    def mine(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(sources, starts) of rank `rank`'s micro-batch of micro-step `step`: [batch_size] each."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        src, starts = self.starts(step, world_size)
        mine = slice(rank * self.batch_size, (rank + 1) * self.batch_size)
        return src[mine], starts[mine]

    def batch(self, step: int, rank: int = 0, world_size: int = 1):
        src, starts = self.mine(step, rank, world_size)  # [batch_size] each
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
