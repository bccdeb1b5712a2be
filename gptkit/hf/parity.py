"""The parity check of a transformers folder `gptkit export` wrote: the folder imported back (gptkit's own
reader) gives the run's logits, and transformers' model of the folder gives them within float error (when
transformers is installed). `gptkit verify`'s export invariant and the model card of `export ...
push_to_hub=` both read it here.

The reference is the run's model with its weights rounded to the export's dtype (what the folder holds), so
a bf16 export is held to the same tolerances as an fp32 one.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import torch

from gptkit.extras import available
from gptkit.hf.folders import import_folder, locate
from gptkit.runs import load_model

# logits: export -> import (the same weights, the same model), transformers' model (another implementation)
LOGITS_SAME, LOGITS_HF = 1e-5, 1e-3


def export_parity(ckpt: Path, folder: Path, dtype: torch.dtype = torch.float32) -> tuple[bool, str]:
    """(whether it holds, one line of what was measured) for the run checkpoint `ckpt` exported as the
    transformers folder `folder` in `dtype`: logits of 2 rows of up to 32 fixed random tokens."""
    _, _, _, model_cfg, model = load_model(ckpt)
    if dtype != torch.float32:
        model = model.to(dtype).float()
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            import_folder(locate(str(folder)), Path(tmp) / "imported", force=True)
        _, _, _, _, back = load_model(Path(tmp) / "imported")
    x = torch.randint(
        0,
        model_cfg.vocab_size,
        (2, min(32, model_cfg.max_seq_len)),
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        want = model(x).logits.float()
        same = float((back.float()(x).logits.float() - want).abs().max())
        hf = "transformers is not installed: its model not compared"
        ok = same <= LOGITS_SAME
        if available("transformers"):
            from transformers import AutoModelForCausalLM

            with contextlib.redirect_stderr(io.StringIO()):
                theirs = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
            diff = float((theirs(x).logits.float() - want).abs().max())
            hf = f"transformers' model of the folder: max |diff| {diff:.2g} (tolerance {LOGITS_HF:g})"
            ok = ok and diff <= LOGITS_HF
    return ok, f"exported and imported back: logits max |diff| {same:.2g} (tolerance {LOGITS_SAME:g}); {hf}"
