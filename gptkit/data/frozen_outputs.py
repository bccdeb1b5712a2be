"""A frozen model's per-row outputs, computed once at prepare time and kept beside the tokens.

    <prepared folder>/frozen/<name>.npz      the arrays of each split (train_*, val_*), by the run's rows
    <prepared folder>/frozen/<name>.json     what produced them, written last (its presence marks them whole):
        format, version, name ("reference", "teacher"), what ("answer_logps": each row's summed target
        log-probs, float32 [rows]; "topk": each label position's top-k token ids int32 and log-probs float16
        [rows, seq_len, k]), model (the checkpoint: path, step, crc32 of its file or of a sharded folder's
        checksums.json), tokenizer_sha256 (the prepared folder's tokenizer.json), seq_len, row_keys (the
        data settings that choose rows: truncate), rows (per split) and rows_crc32 (per split: the CRC-32 of
        the rows' input and target ids, so that any other row layout is seen).

`gptkit prepare ... reference=<run>` or `teacher=<run>` writes them (gptkit/training/precompute.py scores
the rows); a training run reads them (`check_outputs`, then the kind's rows carry them) instead of holding
the frozen model. Writing them never touches the prepared tokens; a second prepare replaces them whole.
"""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.errors import ConfigError
from gptkit.fsio import atomic_write_bytes, atomic_write_text
from gptkit.tokenizer import file_sha256

FOLDER = "frozen"
FORMAT = "gptkit-frozen-outputs"
VERSION = 1


def paths(prepared_dir: Path | str, name: str) -> tuple[Path, Path]:
    """(the arrays, the record) of frozen model `name`'s outputs in a prepared folder."""
    folder = Path(prepared_dir) / FOLDER
    return folder / f"{name}.npz", folder / f"{name}.json"


def rows_crc32(x: Any, y: Any) -> str:
    """The CRC-32 (8 hex digits) of a split's rows: input ids x and target ids y, any shape (int64)."""
    crc = zlib.crc32(np.ascontiguousarray(np.asarray(x, dtype=np.int64)).tobytes())
    crc = zlib.crc32(np.ascontiguousarray(np.asarray(y, dtype=np.int64)).tobytes(), crc)
    return f"{crc:08x}"


def tokenizer_sha256(prepared_dir: Path | str) -> str:
    return file_sha256(Path(prepared_dir) / "tokenizer.json")


def write_outputs(
    prepared_dir: Path | str, name: str, record: dict[str, Any], arrays: dict[str, Any]
) -> Path:
    """The arrays (atomically), then the record (atomically, last): a killed write leaves the old pair or
    none readable, never a record over other arrays (the record holds the arrays' CRC-32)."""
    npz, rec = paths(prepared_dir, name)
    npz.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
    data = buf.getvalue()
    if rec.exists():
        rec.unlink()
    atomic_write_bytes(npz, data)
    full = {
        "format": FORMAT,
        "version": VERSION,
        "name": name,
        **record,
        "npz_crc32": f"{zlib.crc32(data):08x}",
    }
    atomic_write_text(rec, json.dumps(full, indent=1, sort_keys=True))
    return rec


def read_record(prepared_dir: Path | str, name: str) -> dict[str, Any] | None:
    """The record of `name`'s outputs in the folder, or None when there is none."""
    _, rec = paths(prepared_dir, name)
    if not rec.is_file():
        return None
    try:
        out = json.loads(rec.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{rec} cannot be read ({exc}); prepare the outputs again") from None
    if not isinstance(out, dict) or out.get("format") != FORMAT or out.get("version") != VERSION:
        raise ConfigError(f"{rec} is not a version {VERSION} record of {FORMAT}; prepare the outputs again")
    return out


def check_outputs(
    prepared_dir: Path | str,
    name: str,
    what: str,
    model: dict[str, Any],
    seq_len: int,
    rows: dict[str, tuple[Any, Any]],
    row_keys: dict[str, Any],
    redo: str,
) -> dict[str, np.ndarray]:
    """The arrays of `name`'s outputs (`what` they are) in a prepared folder, checked to come from `model`
    ({path, step, crc32}) and the folder's tokenizer over exactly these rows (per split (x, y) of seq_len)
    and row_keys; else one ConfigError that ends with `redo` (the prepare command to run)."""
    npz, _ = paths(prepared_dir, name)
    rec = read_record(prepared_dir, name)
    where = f"{Path(prepared_dir) / FOLDER}"
    if rec is None:
        raise ConfigError(f"{where} holds no precomputed {name} outputs; {redo}")
    if rec.get("what") != what:
        raise ConfigError(f"{where}/{name}.json holds {rec.get('what')!r}, not {what!r}; {redo}")
    saved = rec.get("model") or {}
    if (saved.get("crc32"), saved.get("step")) != (model["crc32"], model["step"]):
        raise ConfigError(
            f"{where}/{name}.json was computed by {saved.get('path')} (step {saved.get('step')}, crc32 "
            f"{saved.get('crc32')}), not by this run's {name} {model['path']} (step {model['step']}, crc32 "
            f"{model['crc32']}); {redo}"
        )
    if rec.get("tokenizer_sha256") != tokenizer_sha256(prepared_dir):
        raise ConfigError(f"{where}/{name}.json was computed with another tokenizer.json; {redo}")
    if int(rec.get("seq_len", -1)) != int(seq_len) or rec.get("row_keys") != row_keys:
        raise ConfigError(
            f"{where}/{name}.json holds rows of seq_len {rec.get('seq_len')} ({rec.get('row_keys')}), this "
            f"run's are seq_len {seq_len} ({row_keys}); {redo}"
        )
    crcs = {split: rows_crc32(x, y) for split, (x, y) in rows.items()}
    if rec.get("rows_crc32") != crcs:
        raise ConfigError(f"{where}/{name}.json was computed over other rows than this run's; {redo}")
    try:
        data = npz.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{npz} cannot be read ({exc}); {redo}") from None
    if f"{zlib.crc32(data):08x}" != rec.get("npz_crc32"):
        raise ConfigError(f"{npz} does not match its record (CRC-32): it is damaged; {redo}")
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}
