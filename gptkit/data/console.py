"""What the data wing prints: one-line messages (say), sizes (human) and the tokenization progress.

Everything goes to stderr as plain text: a path or a field name from the user's data is printed as it is,
never read as markup.
"""

from __future__ import annotations

import sys
import time

# rich is imported for the progress bar of a terminal only.


def say(msg: str) -> None:
    """One message of a prepare (a cache hit, a note, what was built) on stderr."""
    print(msg, file=sys.stderr, flush=True)


def human(n: float, unit: str = "B") -> str:
    """n with an SI prefix and unit, for progress lines: 466.1 kB, 54.0 MB."""
    for p in ("", "k", "M", "G", "T"):
        if abs(n) < 1000 or p == "T":
            return f"{n:.1f} {p}{unit}" if p else f"{n:.0f} {unit}"
        n /= 1000
    return f"{n} {unit}"


class Progress:
    """Tokenization progress on stderr: a bar on a terminal, else a plain line every PLAIN_EVERY_S seconds;
    MB/s of text, tokens so far, an ETA where the size is known. Silent when disabled."""

    PLAIN_EVERY_S = 10.0

    def __init__(self, enabled: bool, total: int | None, label: str) -> None:
        self.enabled, self.total, self.label = enabled, total, label
        self.done = self.tokens = self.skipped = 0
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TransferSpeedColumn(),
                TextColumn("{task.fields[tokens]} tokens"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.task = self.bar.add_task(label, total=total, tokens="0")
            self.bar.start()

    def line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        # of the text tokenized now, not of a killed build's
        rate = (self.done - self.skipped) / dt
        where = human(self.done)
        eta = ""
        if self.total:
            where += f" of {human(self.total)} ({100 * min(self.done / self.total, 1):.0f}%)"
            left = max(self.total - self.done, 0) / rate if rate > 0 else 0
            eta = f", ETA {int(left // 60)}m{int(left % 60):02d}s"
        return f"{self.label}: {where}, {rate / 1e6:.1f} MB/s, {self.tokens:,} tokens{eta}"

    def advance(self, n_bytes: int, n_tokens: int = 0, skipped: bool = False) -> None:
        self.done += n_bytes
        self.skipped += n_bytes if skipped else 0
        self.tokens += n_tokens
        if self.bar is not None:
            self.bar.update(self.task, advance=n_bytes, tokens=f"{self.tokens:,}")
        elif self.enabled and time.perf_counter() - self.last >= self.PLAIN_EVERY_S:
            self.last = time.perf_counter()
            print(self.line(), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.enabled and self.done:
            print(self.line().replace(", ETA 0m00s", ""), file=sys.stderr, flush=True)
