"""JSON-lines corpora tokenized by byte ranges: each task is a range of a file, from a line start to a line
start (gptkit.data.sources.line_ranges: the main process finds each end with a seek and a short read), and
whoever runs it (a tokenization worker; the main process with data.workers=1, and for byte and char, which
encode in the main process) reads the range, decodes it, parses its lines, cuts each record with the
tokenizer's Cutter and encodes the pieces. A record is a whole document, so nothing crosses a range's ends:
the ids are those of reading the file line by line, for any worker count.

The main process only finds the ranges, takes the results in order (RangeChecks raises what spans lines:
no text field in the first records, none in the file...), checksums and writes them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
from tokenizers import Tokenizer

from gptkit.data import tokenize
from gptkit.data.sources import LineRange, RangeChecks, RangeStats, read_range
from gptkit.data.tokenize import Cutter, EncoderSpec, encode_batch

# (range, Cutter mode, Cutter sizes, what the MAX_UNCUT error calls the corpus)
RangeTask = tuple[LineRange, str, dict[str, int], str]

_verify: dict[EncoderSpec, Callable[[str], list[int]]] = {}  # in a worker: HF encode for Cutter mode verify


def _verify_encode(spec: EncoderSpec) -> Callable[[str], list[int]]:
    """The tokenizer's own encode (HF tokenizers), which mode verify checks every cut with."""
    enc = _verify.get(spec)
    if enc is None:
        tok = Tokenizer.from_str(spec.json())
        _verify.clear()
        enc = _verify[spec] = lambda t: tok.encode(t, add_special_tokens=False).ids
    return enc


def encode_range(encode: Callable[[list[str]], list[Any]], spec: EncoderSpec, task: RangeTask):
    """One range -> (ids, documents ended, bytes of the file, the range, RangeStats, forced cuts): its records
    cut as Cutter.pieces cuts them in the main process, encoded as encode_batch does (BOS and EOS included).
    A range with a bad line is not encoded: the main process raises its error in order."""
    r, mode, sizes, what = task
    texts, stats = read_range(r)
    n_bytes = r.end - r.start
    if stats.error is not None or not texts:
        return np.zeros(0, dtype=spec.dtype), 0, n_bytes, r, stats, 0
    cutter = Cutter(mode, spec.specials, _verify_encode(spec) if mode == "verify" else None, sizes)
    batch: list[tuple[str, bool, bool]] = []  # (piece, ends a document, starts a document), as batches()
    fresh = True
    for piece, ends in cutter.pieces(((t, True) for t in texts), spec.eos, what):
        batch.append((piece, ends, fresh))
        fresh = ends
    ids, docs = encode_batch(encode, batch, spec.eos, spec.dtype, spec.bos)
    return ids, docs, n_bytes, r, stats, cutter.forced


class RangeFeed:
    """The tasks of one split of a JSON-lines corpus for write_tokens: its ranges (of about BATCH_CHARS
    bytes), the function that runs one (encode_range), and the checks of the results, in order."""

    run = staticmethod(encode_range)

    def __init__(self, ranges: Callable[[int], Iterator[LineRange]], cutter: Cutter, what: str) -> None:
        self.ranges, self.mode, self.sizes, self.what = ranges, cutter.mode, cutter.sizes(), what
        self.checks = RangeChecks()
        self.forced = 0  # Cutter mode gpt2: cuts inside a pre-token longer than HARD_CHARS

    def tasks(self) -> Iterator[RangeTask]:
        return ((r, self.mode, self.sizes, self.what) for r in self.ranges(tokenize.BATCH_CHARS))

    def skipped(self, task: RangeTask) -> int:
        """A range a killed build already wrote: its bytes, for the progress. It is read again (not encoded)
        only while its file's checks could still fail (the first range or two of a file)."""
        r = task[0]
        if not self.checks.settled(r):
            self.checks.add(r, read_range(r)[1])
        return r.end - r.start

    def done(self, result: tuple[Any, int, int, LineRange, RangeStats, int]) -> None:
        """Check one result (in order); raises the error the line-by-line reader would raise there."""
        _, _, _, r, stats, forced = result
        self.checks.add(r, stats)
        self.forced += forced
