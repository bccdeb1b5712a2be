"""What a user watching a run sees at each validation (rank 0): loss.png redrawn from metrics.csv, and with
trainer.sample_every a short greedy sample, printed and appended to <run>/samples.jsonl.

Both are cheap next to a validation and never fail a run: a plot or a sample that cannot be made is one
note on stderr, once, and training goes on. The sample's prompt is the first tokens of the first
validation window (always in the vocabulary, the same at every validation of the run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.tokenizer import load_tokenizer_file
from gptkit.training.plots import plot_loss

SAMPLE_FILE = "samples.jsonl"
# the prompt: the first tokens of the first validation window
PROMPT_TOKENS = 8
# new tokens of each greedy sample
SAMPLE_TOKENS = 48


class ValidationWatch(Callback):
    """At every validation: loss.png; at the validations that cross a multiple of sample_every steps (and
    the last): a greedy sample. metrics: the run's MetricsCSV (or None: no plot)."""

    def __init__(
        self, run_dir: Path, tokenizer_file: str, sample_every: int | None, metrics: Any = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.tokenizer_file = tokenizer_file
        self.sample_every = sample_every
        self.metrics = metrics
        self._prompt: list[int] | None = None
        # the step of the last sample
        self._sampled_at: int | None = None
        self._noted: set[str] = set()

    def _note(self, what: str, exc: BaseException) -> None:
        if what not in self._noted:
            self._noted.add(what)
            print(
                f"note: {what} failed ({type(exc).__name__}: {str(exc)[:160]}); training goes on",
                file=sys.stderr,
            )

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        """Keep the prompt: the first tokens of the first validation window."""
        if self._prompt is None and self.sample_every:
            self._prompt = batch[0][0, :PROMPT_TOKENS].tolist()

    def on_validation_end(self, trainer, pl_module) -> None:
        """Redraw loss.png (rank 0), then sample if this validation is due one."""
        if trainer.is_global_zero and self.metrics is not None:
            try:
                self.metrics.sync()
                plot_loss(self.run_dir)
            # a plot never fails a run
            except Exception as exc:
                self._note("redrawing loss.png", exc)
        step = trainer.global_step
        if not self.sample_every or self._prompt is None or not self._due(step, trainer.max_steps):
            return
        self._sampled_at = step
        try:
            self._sample(trainer, pl_module, step)
        # a sample never fails a run
        except Exception as exc:
            self._note("the validation sample", exc)

    def _due(self, step: int, max_steps: int) -> bool:
        if step == self._sampled_at:
            return False
        last = -1 if self._sampled_at is None else self._sampled_at // self.sample_every
        return step // self.sample_every > last or step >= max_steps

    def _sample(self, trainer, pl_module, step: int) -> None:
        # every rank runs it (FSDP gathers the shards); rank 0 reports
        model = pl_module.model
        was_training = model.training
        model.eval()
        try:
            opts = SampleOptions(max_new_tokens=SAMPLE_TOKENS, temperature=0.0, decode="eager")
            out = generate(model, self._prompt, opts)
        finally:
            model.train(was_training)
        if not trainer.is_global_zero:
            return
        tok = load_tokenizer_file(self.tokenizer_file)
        prompt, text = tok.decode(self._prompt), tok.decode(out.tokens[0])
        print(f"step {step}  sample: {prompt!r} -> {text!r}", file=sys.stderr)
        with open(self.run_dir / SAMPLE_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "prompt": prompt, "text": text}) + "\n")
        # TensorBoard shows it beside the curves
        for logger in trainer.loggers:
            add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
            if callable(add_text) and type(logger).__name__ == "TensorBoardLogger":
                add_text("sample", f"{prompt} -> {text}", step)
