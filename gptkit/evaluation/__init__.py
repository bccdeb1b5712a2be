"""Evaluation of a run: loss, perplexity and bits per byte over every window of a corpus (corpus.py), and
downstream tasks through lm-eval (tasks.py, with the `LM` adapter in lm_eval_adapter.py).

lm-eval is an optional dependency (`pip install "gptkit[eval]"`): nothing here imports it until a task runs.
"""

from gptkit.evaluation.corpus import (
    SCORINGS,
    evaluate,
    evaluate_sequences,
    lm_eval_documents,
    scored_text_size,
    window_starts,
)

__all__ = [
    "SCORINGS",
    "evaluate",
    "evaluate_sequences",
    "lm_eval_documents",
    "scored_text_size",
    "window_starts",
]
