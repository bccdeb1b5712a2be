"""The face every data kind shows the rest of gptkit: a prepared form, and its feed for one run.

    prepared = gptkit.data.prepare(cfg.data, cfg.tokenizer)     # any kind, one call (gptkit/data/kinds.py)
    prepared.vocab_size, .eos_id, .tokenizer(), .manifest       # what the model and the run folder need
    prepared.describe(), .counts(), .table()                    # what start-up and `gptkit prepare` print
    prepared.run_files()                                        # files the run folder keeps (tokenizer, ...)
    prepared.added_tokens                                       # tokens the kind added to the tokenizer
    feed = prepared.connect(batch_size, seq_len, seed, val_windows, pack)
    feed.sampler.batch(step, rank, world_size)                  # a pure function: resume and ranks exact
    feed.trace(step, rank, world_size)                          # where each of its rows came from (Origin)
    feed.val_set, feed.collate, feed.val_sources                # the fixed validation items
    feed.announce(budget_tokens), feed.consumed(micro_steps, world_size)

The DataModule (gptkit/data/datamodule.py), train and eval read only this face, never which kind they hold
(litgpt's DataModule.connect is the model). A kind is a subclass of Prepared in its own file and a row of
the table in gptkit/data/kinds.py; a mixture (gptkit/data/mixture.py) is itself a Prepared made of parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gptkit.errors import GptkitError
from gptkit.tokenizer import load_tokenizer_file

# in every prepared folder (and, copied, in every run folder)
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class BuildOptions:
    """How a prepare runs: the cache folder it reads and writes, whether it shows progress, whether it
    builds again what the cache holds (force), and the longest row a run will train on, in tokens
    (model.max_seq_len + 1; None: not known): data=chat and data=preference measure a longer conversation
    without encoding it whole and keep only its first row_limit tokens."""

    cache: Path
    progress: bool = True
    force: bool = False
    row_limit: int | None = None


@dataclass
class Span:
    """One document's share of a training row: which document of the split, where it came from and where in
    it the row's tokens are, and how many of them the row holds."""

    # its index among the split's documents (conversations, pairs); None: not known
    document: int | None
    # a file, a built-in corpus's topic, a hub dataset; None: not known
    source: str | None
    # where in the source the row's tokens start: "byte 1,234", "line 57 (byte 1,234), character 12 of its
    # text", "record 3", "token 5,000 (byte 10,000)"; "" when the row starts with the document
    where: str
    # the row's tokens from this document
    tokens: int


@dataclass
class Origin:
    """Where one row (sequence) of a micro-batch came from (Feed.trace)."""

    # the row's index in the micro-batch of its rank
    row: int
    # the mixture's source (data=mix), else None
    part: str | None
    # where the row lies in the prepared data: "token 12,345" of the train shard, "row 17" of a chat split
    position: str
    spans: list[Span]
    # the row's first characters (its input tokens decoded)
    text: str


@dataclass
class Feed:
    """A prepared kind connected to one run's batch shape (litgpt's `connect`): the stateless training
    sampler and the fixed validation items.

    sampler      .batch(step, rank, world_size) -> the micro-batch of that step and rank (a tuple of tensors)
    val_set      a map-style Dataset of validation items, batched by `collate` (None: the default)
    val_sources  (source names, [n_val] source index of each item) when every val item ends with its index
                 in the set (LitGPT then counts each item once under DDP and reports each source); None: the
                 objective reads the items as they are
    lines        what the data says at start-up (rank zero, after the run's own lines)
    tracer       (micro-step, rank, world size, characters) -> the Origin of each row of that micro-batch, as
                 `sampler.batch` draws it (None: the kind cannot say)"""

    sampler: Any
    val_set: Any
    collate: Callable | None = None
    val_sources: tuple[list[str], Any] | None = None
    lines: list[str] = field(default_factory=list)
    tracer: Callable[[int, int, int, int], list[Origin]] | None = None

    def trace(self, step: int, rank: int = 0, world_size: int = 1, chars: int = 80) -> list[Origin]:
        """Where each row of micro-step `step`'s batch on `rank` came from, and its first `chars`
        characters: read from the prepared data, nothing trained (`gptkit trace`)."""
        if self.tracer is None:
            raise GptkitError("this data kind cannot tell where its training rows came from")
        return self.tracer(step, rank, world_size, chars)

    def announce(self, budget_tokens: int | None) -> list[str]:
        """The start-up lines, given the run's token budget (None: unknown)."""
        return list(self.lines)

    def consumed(self, micro_steps: int, world_size: int) -> dict[str, int]:
        """{source: windows drawn from it in micro-steps [0, micro_steps) of all ranks}; {} for one source."""
        return {}


class Prepared(ABC):
    """What every data kind prepares: a folder (its manifest, its tokenizer) and the feed of a run.

    Subclasses set `dir` and `manifest` and write `connect` (and whatever else differs from these
    defaults)."""

    dir: Path
    manifest: dict[str, Any]

    @property
    def tokenizer_path(self) -> Path:
        return self.dir / TOKENIZER

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int | None:
        return self.manifest["tokenizer"].get("eos_id")

    @property
    def added_tokens(self) -> list[str]:
        """Tokens this kind added to the configured tokenizer (a chat template's); a run that starts from
        weights grows its vocabulary for them."""
        return list(self.manifest.get("added_tokens") or [])

    def tokenizer(self):
        return load_tokenizer_file(self.tokenizer_path)

    def wait_checked(self) -> None:
        """Wait for checks running in the background (the shards' CRC-32); a problem is a GptkitError.
        Nothing runs in the background by default."""
        return None

    def run_files(self) -> dict[str, Path]:
        """{file name in the run folder: the file to copy there}: the tokenizer (and a chat template)."""
        return {TOKENIZER: self.tokenizer_path}

    def describe(self) -> str:
        """The `data:` line of a run's start-up."""
        source = self.manifest.get("source", {}).get("description") or self.dir
        return f"{source} ({self.manifest['splits']['train']['tokens']:,} train tokens)"

    def counts(self) -> str:
        """What the folder holds, in a few words (the `prepared ...` and `cache hit ...` lines)."""
        s = self.manifest["splits"]
        return f"{s['train']['tokens']:,} train + {s['val']['tokens']:,} val tokens"

    def table(self) -> list[tuple[str, str]]:
        """(name, value) rows that `gptkit prepare` prints."""
        m = self.manifest
        rows = [
            ("source", str(m["source"]["description"])),
            ("tokenizer", f"{m['tokenizer']['kind']}, vocab {self.vocab_size:,}, eos id {self.eos_id}"),
        ]
        rows += [(f"{split} tokens", f"{m['splits'][split]['tokens']:,}") for split in ("train", "val")]
        return rows + [("tokenizer.json", str(self.tokenizer_path))]

    @abstractmethod
    def connect(
        self, batch_size: int, seq_len: int, seed: int, val_windows: int | None, pack: str | None = None
    ) -> Feed:
        """The feed of a run that draws `batch_size` rows of `seq_len` tokens per micro-step with `seed`;
        val_windows: at most that many validation items (None: all); pack: data.pack (None: the kind's
        default)."""


def check_vocab(prepared: Prepared, model_vocab_size: int) -> None:
    """The model's embedding must have a row for every token id the data can hold."""
    if prepared.vocab_size > int(model_vocab_size):
        raise GptkitError(
            f"the tokenizer has {prepared.vocab_size} tokens but "
            f"model.vocab_size={model_vocab_size}; set model.vocab_size>={prepared.vocab_size} "
            "(or let train take it from the tokenizer)"
        )
