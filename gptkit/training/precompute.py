"""A frozen model run once over prepared rows, its per-row outputs written beside the tokens, so that training
reads them instead of holding the model (the format: gptkit/data/frozen_outputs.py).

    gptkit prepare data=preference ... rows=<trainer.seq_len> reference=<run or checkpoint>
        -> <prepared folder>/frozen/reference.{npz,json}: each row's summed answer log-probs (fp32), the
           reference of objective=dpo with dpo.reference=precomputed (score_reference)
    gptkit prepare data=chat ... rows=<trainer.seq_len> teacher=<run or checkpoint> top_k=64
        -> <prepared folder>/frozen/teacher.{npz,json}: at every label position of every training row, the
           teacher's top-k token ids (int32) and log-probs (fp32), for objective=distill with
           distill.teacher=precomputed (objectives/distill_topk.py: the loss over them)
    gptkit train objective=dpo dpo.reference=precomputed ...   (or objective=distill distill.teacher=...)
        -> attach_precomputed (at start-up, before the run folder gets its files): the outputs must come
           from the run's frozen.<name> (by default the starting weights: init_from=), the data folder's
           tokenizer and exactly the run's rows (seq_len, data.truncate, the rows' CRC-32); else one line,
           exit 2; then the rows carry them and no frozen model is built or loaded.

The scores are the live model's own function (the reference: target_logps, chunked; the teacher: its
logits' log_softmax), eval mode, no grad, on the rows the run draws (pair_rows, chat_rows), in fp32: a run
with dpo.reference=precomputed computes the losses a live-reference run computes in fp32
(tests/training/test_dpo.py), and distill.teacher=precomputed with top_k = the vocabulary those of a live
teacher (tests/training/test_distill.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gptkit.checkpoints import checkpoint_step, is_sharded_checkpoint
from gptkit.data import frozen_outputs
from gptkit.errors import ConfigError, GptkitError
from gptkit.fsio import file_crc32
from gptkit.training.objectives.base import evaluating, target_logps


def checkpoint_identity(ckpt: Path | str) -> dict[str, Any]:
    """{path, step, crc32} of a checkpoint file (crc32 of the file) or sharded folder (of its
    checksums.json, which holds every shard's): what a record of precomputed outputs names."""
    ckpt = Path(ckpt).resolve()
    target = ckpt / "checksums.json" if is_sharded_checkpoint(ckpt) else ckpt
    return {"path": str(ckpt), "step": int(checkpoint_step(ckpt)), "crc32": file_crc32(target)}


# per frozen model name: what its outputs are, the data kind they are read from, the option that reads them
# and its docs
NAMES = {
    "reference": ("answer_logps", "preference", "dpo.reference=precomputed", "docs/dpo.md"),
    "teacher": ("topk", "chat", "distill.teacher=precomputed", "docs/distillation.md"),
}


def _redo(name: str, ckpt: Path, seq_len: int) -> str:
    _, _, option, doc = NAMES[name]
    return (
        f"compute them with `gptkit prepare <this run's data= and tokenizer= options> rows={seq_len} "
        f"{name}={ckpt}` ({doc}), or drop {option}"
    )


def frozen_checkpoint(plan: Any, name: str) -> Path:
    """The checkpoint of the run's frozen model `name`: its own source (plan.frozen), else the starting
    weights (init_from=, read again from the config in a resumed run)."""
    from gptkit.runs import find_run_checkpoint
    from gptkit.training.start import HF_PREFIX, import_init_source

    source = (plan.frozen or {}).get(name)
    if source is not None:
        return Path(source.checkpoint)
    if plan.init_from is not None:
        return Path(plan.init_from)
    given = str(plan.cfg.init_from)
    if given.startswith(HF_PREFIX):
        given, _ = import_init_source(given[len(HF_PREFIX) :], Path(plan.cfg.runs_dir))
    return Path(find_run_checkpoint(given, plan.cfg.runs_dir))


def rows_of(
    data: Any, name: str, seq_len: int, pack: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """({split: rows} the outputs of `name` are kept for, the data settings that choose them) of a prepared
    folder at seq_len; one ConfigError when the data is not the kind they are read from."""
    from gptkit.data.chat import ChatData, chat_rows
    from gptkit.data.preference import PreferenceData, pair_rows

    kind = NAMES[name][1]
    if name == "reference" and isinstance(data, PreferenceData):
        return dict(zip(("train", "val"), pair_rows(data, seq_len))), {"truncate": data.settings["truncate"]}
    if name == "teacher" and isinstance(data, ChatData):
        pack = pack or data.settings["pack"]
        keys = {"pack": pack, "train_on": data.settings["train_on"], "truncate": data.settings["truncate"]}
        # validation is the labels' cross-entropy: the training rows only
        return {"train": chat_rows(data, seq_len, pack)[0]}, keys
    raise ConfigError(
        f"a precomputed {name} is kept for data={kind} rows (fixed rows, each scored once); this data is "
        f"{type(data).__name__}" + ("" if kind != "chat" else ": a text corpus's windows start anywhere")
    )


def attach_precomputed(plan: Any) -> None:
    """The precomputed outputs of the run's objective (precomputed_models), checked against the run's frozen
    model, tokenizer and rows, given to the prepared data (its rows then carry them); one ConfigError
    otherwise. Nothing when the objective reads none."""
    from gptkit.training.objectives import objective_class

    objective = objective_class(plan.cfg)
    for name in objective.precomputed_models(objective.settings_of(plan.cfg)):
        ckpt = frozen_checkpoint(plan, name)
        data = plan.data
        rows, keys = rows_of(data, name, plan.seq_len, plan.cfg.data.get("pack"))
        arrays = frozen_outputs.check_outputs(
            data.dir,
            name,
            NAMES[name][0],
            checkpoint_identity(ckpt),
            plan.seq_len,
            {split: (r.x, r.y) for split, r in rows.items()},
            keys,
            _redo(name, ckpt, plan.seq_len),
        )
        data.outputs[name] = arrays


def answer_logps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Each row's summed target log-probs [N] (fp32) of rows x, y [N, T], batch_size rows at a time."""
    device = next(model.parameters()).device
    out = []
    with evaluating(model):
        for i in range(0, x.shape[0], batch_size):
            xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
            out.append(target_logps(model, xb, yb).sum(-1).float().cpu())
    return torch.cat(out) if out else torch.zeros(0)


def topk_logps(
    model: torch.nn.Module, rows: Any, k: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(offsets [N + 1] int64, ids [M, k] int32, log-probs [M, k] fp32): the model's k most likely next
    tokens and their log-probs (log_softmax of its fp32 logits) at the M label positions of rows (x, y
    [, doc_ids] [N, T]), row by row in order."""
    device = next(model.parameters()).device
    ids, logps, counts = [], [], []
    with evaluating(model):
        for i in range(0, rows.x.shape[0], batch_size):
            x = rows.x[i : i + batch_size].to(device)
            y = rows.y[i : i + batch_size]
            docs = None if rows.doc_ids is None else rows.doc_ids[i : i + batch_size].to(device)
            logits = model(x, doc_ids=docs).logits.float().cpu()  # [B, T, V]
            mask = y != -100  # [B, T]
            top = F.log_softmax(logits[mask], dim=-1).topk(min(k, logits.shape[-1]), dim=-1)  # [m, k]
            ids.append(top.indices.to(torch.int32))
            logps.append(top.values)
            counts.append(mask.sum(-1))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(counts).cumsum(0)])
    return offsets, torch.cat(ids), torch.cat(logps)


def score(
    data: Any,
    name: str,
    source: str,
    seq_len: int,
    top_k: int = 64,
    batch_size: int = 8,
    device: str = "cpu",
    runs_dir: str = "runs",
) -> Path:
    """The frozen model `name` (reference: each preference row's summed answer log-probs; teacher: the top-k
    of every label position of the chat training rows) over the rows of seq_len, from `source` in fp32,
    written beside the tokens (gptkit/data/frozen_outputs.py); its record's path."""
    from gptkit.runs import find_run_checkpoint, load_model

    rows, keys = rows_of(data, name, seq_len)
    ckpt = Path(find_run_checkpoint(source, runs_dir))
    check_tokenizer(data, ckpt, name, source)
    *_, model_cfg, model = load_model(ckpt, device=device, dtype="float32")
    if model_cfg.max_seq_len < seq_len:
        raise ConfigError(
            f"{name}={source} reads at most {model_cfg.max_seq_len} tokens (model.max_seq_len); rows="
            f"{seq_len} is longer"
        )
    record = {
        "what": NAMES[name][0],
        "model": checkpoint_identity(ckpt),
        "tokenizer_sha256": frozen_outputs.tokenizer_sha256(data.dir),
        "seq_len": int(seq_len),
        "row_keys": keys,
        "rows_crc32": {split: frozen_outputs.rows_crc32(r.x, r.y) for split, r in rows.items()},
    }
    arrays = {}
    for split, r in rows.items():
        if name == "reference":
            arrays[f"{split}_logps"] = answer_logps(model, r.x.flatten(0, 1), r.y.flatten(0, 1), batch_size)
        else:
            offsets, ids, logps = topk_logps(model, r, top_k, batch_size)
            arrays.update({f"{split}_offsets": offsets, f"{split}_ids": ids, f"{split}_logps": logps})
            record["top_k"] = int(ids.shape[1])
    record["dtype"] = "float32 log-probs" + (", int32 token ids" if name == "teacher" else "")
    record["rows"] = {split: int(r.y.reshape(-1, r.y.shape[-1]).shape[0]) for split, r in rows.items()}
    return frozen_outputs.write_outputs(data.dir, name, record, {k: v.numpy() for k, v in arrays.items()})


def check_tokenizer(data: Any, ckpt: Path, key: str, source: str) -> None:
    """The frozen model's tokenizer must be the data's (every token at the same id), else one line."""
    from gptkit.checkpoints import run_dir_of
    from gptkit.runs import load_tokenizer

    try:
        theirs = load_tokenizer(run_dir_of(ckpt)).get_vocab(with_added_tokens=True)
    except GptkitError as exc:
        raise ConfigError(f"{key}={source}: {exc}") from None
    if data.tokenizer().get_vocab(with_added_tokens=True) != theirs:
        raise ConfigError(
            f"{key}={source} has another vocabulary than the data's tokenizer ({data.tokenizer_path}); "
            f"prepare with its tokenizer: tokenizer=file tokenizer.path={run_dir_of(ckpt) / 'tokenizer.json'}"
        )
