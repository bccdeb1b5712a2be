"""Hugging Face folders: safetensors shards and tokenizer files written and read, a model found in a local
folder or on the Hub (fetched into the Hugging Face cache by `huggingface_hub`), and a folder imported as a
gptkit run folder (`gptkit import`, `train init_from=hf:...`). The mapping between a gptkit GPT and the
transformers architectures is gptkit/hf/convert.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch

from gptkit import hub
from gptkit.chat_templates import CHAT_FILE, ChatTemplate, reply_stop_ids, template_in_folder
from gptkit.errors import GptkitError
from gptkit.fsio import FILE_MODE, confined, staged_dir
from gptkit.hf.convert import (
    ARCHITECTURES,
    check_hf_config,
    check_weight_sizes,
    files_config,
    from_hf_state_dict,
    heads_confirmed,
    hf_config,
    model_config_from_hf,
    to_hf_state_dict,
    unpack_weights,
)
from gptkit.model import GPT
from gptkit.runs import (
    IMPORTED_FILE,
    TOKENIZER_FILE,
    check_import_out,
    check_tokenizer_fits,
    load_model,
    load_tokenizer,
    write_run_folder,
)
from gptkit.tokenizer import special_tokens

# huggingface_hub is imported where a Hub model is fetched: `gptkit import` of a local folder needs no hub.


# ---- folders: safetensors shards and tokenizer files -------------------------------------------
SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def parse_size(size: str | int) -> int:
    """'5GB' / '500MB' / '20KB' / 1000 -> bytes (decimal units, as transformers' max_shard_size)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise GptkitError(f"max_shard_size={size!r} is not a size; write e.g. 5GB, 500MB or 20KB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * scale)


def save_weights(state: dict[str, Any], out_dir: Path, max_shard_size: int) -> list[str]:
    """Write `state` as model.safetensors, or as numbered shards plus an index when larger than
    max_shard_size. Returns the file names written."""
    from safetensors.torch import save_file

    shards: list[dict[str, Any]] = [{}]
    size = 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    names = (
        [SAFE_SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards):
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        # safetensors writes owner-only files
        os.chmod(out_dir / name, FILE_MODE)
    if len(shards) == 1:
        return names
    weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2))
    return names + [SAFE_INDEX]


def load_weights(hf_dir: Path) -> dict[str, Any]:
    """All tensors of a transformers folder: safetensors (single or sharded), else pytorch_model.bin
    loaded with weights_only=True (a pickle that would run code is refused)."""
    from safetensors.torch import load_file

    def safe(f: Path) -> dict[str, Any]:
        try:
            return load_file(str(f))
        except Exception as exc:
            raise GptkitError(f"{f} is not a readable safetensors file ({str(exc)[:160]})") from exc

    def pickle(f: Path) -> dict[str, Any]:
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:
            from gptkit.checkpoints import load_refusal

            raise GptkitError(
                f"{f} could not be loaded safely: it {load_refusal(f, exc)}; convert it to safetensors"
            ) from exc
        if not isinstance(obj, dict):
            raise GptkitError(f"{f} does not hold a state dict")
        return obj

    files, is_safe = weight_files(hf_dir)
    state: dict[str, Any] = {}
    for f in files:
        state.update((safe if is_safe else pickle)(f))
    return state


def weight_files(hf_dir: Path) -> tuple[list[Path], bool]:
    """(the weight files of a transformers folder, whether they are safetensors): model.safetensors, the
    shards its index names (never outside the folder), else pytorch_model.bin or its shards."""
    for single, index, safe in ((SAFE_SINGLE, SAFE_INDEX, True), (BIN_SINGLE, BIN_INDEX, False)):
        if (hf_dir / single).is_file():
            return [hf_dir / single], safe
        if (hf_dir / index).is_file():
            try:
                names = sorted(set(json.loads((hf_dir / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError, TypeError) as exc:
                raise GptkitError(f"{hf_dir / index} is not a valid weight index ({exc})") from exc
            files = []
            for name in names:
                # never a file outside the model folder
                f = confined(hf_dir, name, hf_dir / index)
                if not f.is_file():
                    raise GptkitError(f"{hf_dir / index} names {name}, which is missing from {hf_dir}")
                files.append(f)
            return files, safe
    raise GptkitError(
        f"no weights in {hf_dir} (looked for {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE}, {BIN_INDEX})"
    )


def safetensors_shapes(f: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a safetensors file, from its header alone (8 bytes of length, then JSON): nothing
    read beyond it, nothing allocated."""
    bad = f"{f} is not a readable safetensors file"
    try:
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= f.stat().st_size - 8:
                raise GptkitError(f"{bad} (its header length is {n}, the file {f.stat().st_size:,} bytes)")
            header = json.loads(fh.read(n))
        return {k: tuple(int(x) for x in v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise GptkitError(f"{bad} ({str(exc)[:160]})") from exc


def weight_shapes(hf_dir: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Any] | None]:
    """({name: shape} of every weight of a transformers folder, the weights when they had to be loaded to
    know it): safetensors from their headers, nothing loaded (None); pickles loaded (weights_only=True)."""
    files, safe = weight_files(hf_dir)
    if not safe:
        state = load_weights(hf_dir)
        return {k: tuple(getattr(v, "shape", ())) for k, v in state.items()}, state
    return {k: v for f in files for k, v in safetensors_shapes(f).items()}, None


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    f = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise GptkitError(
            f"{hf_dir} is not a folder; pass a local transformers model folder or a Hugging "
            f"Face Hub model id (owner/name[@revision])"
        )
    if not f.is_file():
        raise GptkitError(f"{hf_dir} is not a transformers model folder (no config.json in it)")
    try:
        d = json.loads(f.read_text())
    except ValueError as exc:
        raise GptkitError(f"{f} is not valid JSON ({exc})") from exc
    if not isinstance(d, dict):
        raise GptkitError(f"{f} is not a transformers config (not a JSON object)")
    return d


def tokenizer_files(
    tokenizer, max_seq_len: int, special: dict[str, tuple[str, int]], template: ChatTemplate | None = None
) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for AutoTokenizer
    (`special`: {role: (token, id)}, as gptkit.tokenizer.special_tokens() finds them). With a chat template:
    its text as tokenizer_config.json's chat_template and as chat_template.jinja, and the special tokens it
    renders with (bos_token, eos_token...: its variables, which the tokenizer must hold) in those roles, so
    apply_chat_template renders a conversation as gptkit does."""
    special = {role: tok for role, (tok, _) in special.items()}
    files = {}
    if template is not None:
        held = {k: v for k, v in template.variables.items() if tokenizer.token_to_id(v) is not None}
        special.update(held)
        files["chat_template.jinja"] = template.text
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    if template is not None:
        config["chat_template"] = template.text
    return {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
        "special_tokens_map.json": json.dumps(special, indent=2),
        **files,
    }


def generation_config(
    bos_id: int | None, eos_id: int | list[int] | None, pad_id: int | None
) -> dict[str, Any]:
    """generation_config.json; eos_id may be a list (a chat model: end-of-turn, then end-of-text), at any of
    which generate() stops."""
    d: dict[str, Any] = {"_from_model_config": True}
    d.update(
        {
            k: v
            for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id), ("pad_token_id", pad_id))
            if v is not None
        }
    )
    return d


# ---- sources: a local folder or a Hugging Face Hub model ---------------------------------------
HUB_FIRST = [
    "config.json",
    # fetched first: an unsupported model fails before its weights
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    # the chat template (gptkit chat, data=chat)
]
HUB_WEIGHTS = [SAFE_SINGLE, "model-*-of-*.safetensors", SAFE_INDEX]
# only for a model without safetensors
HUB_PICKLES = [BIN_SINGLE, "pytorch_model-*-of-*.bin", BIN_INDEX]
# owner/name[@revision] (or a legacy name)
HUB_ID = re.compile(r"[\w-][\w.-]*(?:/[\w-][\w.-]*)?(?:@[\w./-]+)?")
LOCAL_IMPORT = "gptkit import hf=/path/to/folder out=runs/<name>"


@dataclass
class Source:
    """A transformers folder on this machine, and where it came from."""

    dir: Path
    # the default model (and folder) name: the folder's or the repository's
    name: str
    # what names exactly these files again: the resolved folder, or owner/name@commit
    spec: str
    # worth one line on stderr (e.g. an unreachable hub left only the cache)
    note: str | None = None


def source_name(spec: str) -> str:
    """The name `locate(spec)` gives its Source (the folder's, or the repository's), fetching nothing."""
    path = Path(spec).expanduser()
    if path.exists() or not HUB_ID.fullmatch(spec):
        return path.resolve().name
    return spec.partition("@")[0].rsplit("/", 1)[-1]


def locate(spec: str, local_alternative: str = LOCAL_IMPORT) -> Source:
    """`hf=<spec>` as a transformers folder on this machine: a local folder (it wins whenever it exists, even
    one named like owner/name), else a Hugging Face Hub model id, owner/name[@revision], fetched into the
    Hugging Face cache. `local_alternative` is the command that uses a local folder instead, for the message
    that the hub cannot be used."""
    path = Path(spec).expanduser()
    if path.exists() or not HUB_ID.fullmatch(spec):
        return Source(path, source_name(spec), str(path.resolve()))
    repo_id, _, revision = spec.partition("@")
    return _fetch(repo_id, revision or None, local_alternative)


def _fetch(repo_id: str, revision: str | None, local_alternative: str) -> Source:
    """What import reads of a Hub model (config.json and tokenizer.json first, then the safetensors weights,
    and pytorch_model.bin only when there are none), downloaded into the Hugging Face cache by huggingface_hub
    with its progress bars. Offline (HF_HUB_OFFLINE=1) or with the hub unreachable (a connect with a short
    timeout, no retries), only the cache is read: a model already there works, any other fails at once with
    one line."""
    from huggingface_hub import constants, errors, snapshot_download

    unreachable = None
    if not hub.offline():
        try:
            hub.check_hub_reachable(hub.TIMEOUT_S)
        except GptkitError as exc:
            unreachable = str(exc)
    if unreachable:
        not_cached = (
            f"{repo_id} is not a local folder, nor in the Hugging Face cache, and {unreachable}; "
            f"without network (HF_HUB_OFFLINE=1) only models in that cache and local folders work: "
            f"{local_alternative}"
        )
    else:
        not_cached = (
            f"{repo_id} is not a local folder, nor (completely) in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE=1 forbids downloading it; unset "
            "HF_HUB_OFFLINE to download it, or use a local transformers folder: "
            f"{local_alternative}"
        )
    local_only = unreachable is not None or hub.offline()

    def get(patterns: list[str], rev: str | None) -> Path:
        try:
            return Path(
                snapshot_download(repo_id, revision=rev, allow_patterns=patterns, local_files_only=local_only)
            )
        except errors.GatedRepoError:
            raise GptkitError(
                f"{repo_id} is a gated model: accept its conditions on its Hub page and log in "
                f"(`hf auth login` or HF_TOKEN), then try again"
            ) from None
        except errors.RepositoryNotFoundError:
            raise GptkitError(
                f"{repo_id} is neither a local folder nor a model on the Hugging Face Hub "
                f"(check the name; a private model needs `hf auth login` or "
                f"HF_TOKEN)"
            ) from None
        except errors.RevisionNotFoundError:
            raise GptkitError(
                f"{repo_id} has no revision {rev!r} on the Hugging Face Hub; give a branch, "
                f"tag or commit it has: {repo_id}@<revision>"
            ) from None
        # offline and not (completely) in the cache
        except errors.LocalEntryNotFoundError:
            raise GptkitError(not_cached) from None
        except errors.HFValidationError as exc:
            raise GptkitError(
                f"{repo_id} is neither a local folder nor a valid Hub model id (owner/name): "
                f"{str(exc).splitlines()[0][:160]}"
            ) from None
        # the network or the hub failed part-way
        except Exception as exc:
            raise GptkitError(
                f"cannot download {repo_id} from the Hugging Face Hub ({type(exc).__name__}: "
                f"{(str(exc).splitlines() or [''])[0][:160]}); try again, or use a local "
                f"folder: {local_alternative}"
            ) from None

    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    # e.g. "No files matched" for a model without safetensors: we handle it
    hub_log.setLevel(logging.ERROR)
    try:
        folder = get(HUB_FIRST, revision)
        # a snapshot folder is named by its commit: the later calls fetch exactly this one
        commit = folder.name
        if not (folder / "config.json").is_file():
            raise GptkitError(
                f"{repo_id} has no config.json: it is not a transformers model (gptkit imports "
                f"{', '.join(ARCHITECTURES.values())})"
            )
        # an unsupported model fails before its weights download
        model_config_from_hf(read_hf_config(folder))
        folder = get(HUB_WEIGHTS, commit)
        if not any((folder / f).is_file() for f in (SAFE_SINGLE, SAFE_INDEX)):
            # read with weights_only=True: a pickle that would run code is refused
            folder = get(HUB_PICKLES, commit)
    finally:
        hub_log.setLevel(level)
    note = f"{unreachable}; using {repo_id}@{commit} from the Hugging Face cache" if unreachable else None
    return Source(folder, source_name(repo_id), f"{repo_id}@{commit}", note)


def fingerprint(folder: Path) -> list[list[Any]]:
    """[name, size, mtime_ns] of the files import reads from `folder`: an import of it is current while this
    holds."""
    patterns = HUB_FIRST + HUB_WEIGHTS + HUB_PICKLES
    if not folder.is_dir():
        return []
    files = sorted(f for f in folder.iterdir() if f.is_file() and any(fnmatch(f.name, p) for p in patterns))
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


@dataclass
class Imported:
    out: Path
    model_type: str | None
    n_params: int
    # of the source tensors (the run folder holds fp32)
    dtypes: list[str]
    has_tokenizer: bool
    # what the weight shapes confirm about the attention heads (heads_confirmed)
    heads: str
    # tokenizer_config.json's chat_template, kept as chat.json
    has_chat_template: bool = False
    # what import did beyond widening (gpt-oss's MXFP4 experts dequantized), one line each
    notes: list[str] | None = None


@dataclass
class Exported:
    """What export_folder wrote."""

    checkpoint: Path
    run_dir: Path
    model_cfg: Any
    weights: list[str]
    n_params: int
    # the run's tokenizer (None: the run has none, and the folder no tokenizer files)
    tokenizer: Any
    # the tokenizer has an end-of-text token
    has_eos: bool
    # a chat model's template (None: not a chat model), and the ids generation stops at
    template: Any = None
    stop_ids: list[int] | None = None


def export_folder(ckpt: Path, out: Path, dtype: torch.dtype, max_shard: int, force: bool = False) -> Exported:
    """Write the run's checkpoint `ckpt` as the transformers folder `out` (`gptkit export`): config.json, the
    safetensors weights (in `dtype`, shards above max_shard bytes), generation_config.json and the tokenizer's
    files; written whole or not at all (staged_dir)."""
    run_dir, ckpt, run_cfg, model_cfg, model = load_model(ckpt)
    tokenizer = load_tokenizer(run_dir) if (Path(run_dir) / TOKENIZER_FILE).is_file() else None
    if tokenizer is not None:
        check_tokenizer_fits(run_dir, tokenizer.get_vocab_size(), model_cfg.vocab_size)
    # what training appended after each document
    eos = (run_cfg.get("tokenizer") or {}).get("eos_token")
    special = special_tokens(tokenizer, eos) if tokenizer is not None else {}
    ids = {
        role: special[role][1] if role in special else None
        for role in ("bos_token", "eos_token", "pad_token")
    }
    # a chat model (data=chat, or imported with a template): its template, and generation stops at the end
    # of a turn as well as at the end of the text
    template = template_in_folder(Path(run_dir)) if tokenizer is not None else None
    stop_ids = reply_stop_ids(tokenizer, template, eos) if template is not None else []
    gen_eos = stop_ids if len(stop_ids) > 1 else (stop_ids[0] if stop_ids else ids["eos_token"])
    # the expert bias stays fp32 (DeepSeek-V3's e_score_correction_bias: fp32 in its files and transformers)
    state = {k: v if k.endswith(".mlp.expert_bias") else v.to(dtype) for k, v in model.state_dict().items()}
    state = to_hf_state_dict(state, model_cfg)
    config = hf_config(
        model_cfg, ids["bos_token"], ids["eos_token"], ids["pad_token"], str(dtype).removeprefix("torch.")
    )
    with staged_dir(out, force=force) as tmp:
        weights = save_weights(state, tmp, max_shard)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        gen = generation_config(ids["bos_token"], gen_eos, ids["pad_token"])
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if tokenizer is not None:
            files = tokenizer_files(tokenizer, model_cfg.max_seq_len, special, template)
            for name, text in files.items():
                (tmp / name).write_text(text, encoding="utf-8")
    n_params = sum(v.numel() for v in state.values())
    return Exported(
        ckpt,
        Path(run_dir),
        model_cfg,
        weights,
        n_params,
        tokenizer,
        "eos_token" in special,
        template,
        stop_ids,
    )


def import_folder(src: Source, out: Path, force: bool = False, name: str | None = None) -> Imported:
    """Write the transformers folder src.dir as the gptkit run folder `out`: config.yaml, tokenizer.json (when
    the folder has one), checkpoints/last.ckpt (fp32; lower-precision sources widened exactly) and
    imported_from.json. `out` is written whole or not at all; a non-empty `out` needs force=True, and is never
    the source, around it, a run with training in it or a run another process holds
    (runs.check_import_out)."""
    check_import_out(out, src.dir, force)

    hf_cfg = read_hf_config(src.dir)
    check_hf_config(hf_cfg)
    # the config's sizes against the weights' headers, before anything is sized by them
    shapes, loaded = weight_shapes(src.dir)
    check_weight_sizes(hf_cfg, shapes, str(src.dir))
    model_cfg = model_config_from_hf(hf_cfg, name=name or src.name)
    tokenizer = load_tokenizer(src.dir) if (src.dir / TOKENIZER_FILE).is_file() else None
    # the check sample, eval and chat make of a run (runs.check_tokenizer_fits), before the weights are read
    if tokenizer is not None and tokenizer.get_vocab_size() > model_cfg.vocab_size:
        raise GptkitError(
            f"{src.dir / TOKENIZER_FILE} has {tokenizer.get_vocab_size():,} tokens but the model has "
            f"{model_cfg.vocab_size:,} (vocab_size in {src.dir / 'config.json'}): it is not this model's "
            f"tokenizer (its ids would have no embedding row); import a folder with the model's own tokenizer"
        )
    source = loaded if loaded is not None else load_weights(src.dir)
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in source.values()})
    source, note = unpack_weights(source, hf_cfg, str(src.dir))
    notes = [note] if note else []
    model_cfg, files_note = files_config(hf_cfg, model_cfg, source, str(src.dir))
    notes += [files_note] if files_note else []
    model = GPT.from_state(
        model_cfg, from_hf_state_dict(source, model_cfg, source=str(src.dir), model_type=hf_cfg["model_type"])
    )
    # tokenizer_config.json's
    template = template_in_folder(src.dir) if tokenizer is not None else None
    with staged_dir(out, force=force) as tmp:
        write_run_folder(tmp, {}, model, tokenizer)
        if template is not None:
            (tmp / CHAT_FILE).write_text(template.to_json())
        provenance = {
            "source": src.spec,
            "architectures": hf_cfg.get("architectures"),
            "model_type": hf_cfg.get("model_type"),
            "dtypes": dtypes,
            "files": fingerprint(src.dir),
        }
        if notes:
            provenance["notes"] = notes
        (tmp / IMPORTED_FILE).write_text(json.dumps(provenance, indent=2))
    return Imported(
        out,
        hf_cfg.get("model_type"),
        model.num_parameters(),
        dtypes,
        tokenizer is not None,
        heads_confirmed(hf_cfg, model_cfg),
        template is not None,
        notes,
    )


def import_cached(spec: str, runs_dir: Path | str, local_alternative: str) -> tuple[Path, Source, bool]:
    """For `train init_from=hf:<spec>`: the run folder <runs_dir>/<name>-imported holding `spec`, imported now
    or reused (True) when it already holds these very files (the same hub commit, or the same local folder
    unchanged). Processes started together (torchrun ranks) import once: the others wait and reuse it."""
    from filelock import FileLock

    src = locate(spec, local_alternative)
    out = Path(runs_dir) / f"{src.name}-imported"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        try:
            held = json.loads((out / IMPORTED_FILE).read_text())
        except (OSError, ValueError):
            held = None
        if (
            isinstance(held, dict)
            and held.get("source") == src.spec
            and held.get("files") == fingerprint(src.dir)
        ):
            return out, src, True
        if not isinstance(held, dict) and out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise GptkitError(
                f"{out} exists and is not an import by gptkit; move it away, or import into a "
                f"folder of your choice (gptkit import hf={spec} out=<folder>) and pass "
                "init_from=<folder>"
            )
        done = import_folder(src, out, force=True)
    if done.notes:
        src = dataclasses.replace(src, note="; ".join(filter(None, (src.note, *done.notes))))
    return out, src, False
