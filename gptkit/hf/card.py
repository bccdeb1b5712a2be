"""The model card (README.md) `gptkit export ... push_to_hub=` uploads with an export: YAML front matter the
Hub reads (library_name, license when known, tags, base_model of an adapter, datasets of the data
manifest), then what the run was: its config, its parameter counts, the data it trained on (the manifest:
the source, its provenance, the token counts), the eval table of its results files, the export's parity
check, and the files the export holds. Everything comes from the run folder and the export; nothing is made
up: a section whose source is missing says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

# what library loads each kind of export (the front matter's library_name); None: none (a GGUF file)
LIBRARIES = {"transformers": "transformers", "adapters": "peft", "gguf": None, "files": None}


def export_kind(out: Path) -> str:
    """What an export is, by its files: transformers (config.json), adapters (adapter_config.json), gguf (a
    .gguf file, or a folder of them), files (anything else)."""
    names = [out.name] if out.is_file() else [p.name for p in out.iterdir()] if out.is_dir() else []
    if "adapter_config.json" in names:
        return "adapters"
    if "config.json" in names:
        return "transformers"
    if any(n.lower().endswith(".gguf") for n in names):
        return "gguf"
    return "files"


def export_files(out: Path) -> list[tuple[str, int]]:
    """(name, bytes) of the export's files (the card itself left out)."""
    if out.is_file():
        return [(out.name, out.stat().st_size)]
    return sorted(
        (p.relative_to(out).as_posix(), p.stat().st_size)
        for p in out.rglob("*")
        if p.is_file() and p.relative_to(out).as_posix() != "README.md"
    )


def datasets_of(manifest: dict[str, Any] | None) -> list[str]:
    """The Hub datasets the data manifest names (hf: paths of the templated kinds, data=hub's name)."""
    if not manifest:
        return []
    source = manifest.get("source") or {}
    out = [h["repo"] for h in source.get("hub") or [] if h.get("repo")]
    settings = source.get("settings") or {}
    if source.get("kind") == "hub" and settings.get("name"):
        out.append(str(settings["name"]))
    return list(dict.fromkeys(out))


def base_model_of(out: Path) -> str | None:
    """An adapter's base model as PEFT's adapter_config.json names it, when it is a Hub id (owner/name)."""
    f = out / "adapter_config.json" if out.is_dir() else None
    if f is None or not f.is_file():
        return None
    base = str(json.loads(f.read_text()).get("base_model_name_or_path") or "")
    base = base.partition("@")[0]
    return base if base.count("/") == 1 and not Path(base).is_absolute() and not Path(base).exists() else None


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _fmt(v: Any) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def model_card(
    out: Path,
    repo_id: str,
    run_dir: Path,
    run_cfg: dict[str, Any],
    counts: Any,
    manifest: dict[str, Any] | None,
    evals: list[dict[str, Any]],
    parity: str,
    license: str | None = None,
) -> str:
    """The card's text.

    counts: gptkit.accounting.ParamCounts of the run's model (None: unknown); evals: rows
    (task, metric, value, stderr, n) of the run's results files;
    parity: the export's parity check (one line)."""
    kind = export_kind(out)
    model = run_cfg.get("model") or {}
    front: dict[str, Any] = {}
    if LIBRARIES[kind]:
        front["library_name"] = LIBRARIES[kind]
    if license:
        front["license"] = license
    front["tags"] = ["gptkit", "text-generation"] + ([kind] if kind in ("gguf",) else [])
    if kind == "adapters":
        front["tags"] += ["peft", "lora"]
        base = base_model_of(out)
        if base:
            front["base_model"] = base
    data = datasets_of(manifest)
    if data:
        front["datasets"] = data
    name = repo_id.rsplit("/", 1)[-1]
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {name}", ""]
    what = {
        "transformers": "a transformers model (AutoModelForCausalLM)",
        "adapters": "LoRA adapters in PEFT's format (PeftModel.from_pretrained on the base model)",
        "gguf": "a GGUF file (llama.cpp)",
        "files": "files",
    }[kind]
    lines += [
        f"{what}, trained with gptkit and exported by `gptkit export` from the run `{run_dir.name}`.",
        "",
        "## Model",
        "",
    ]
    if counts is not None:
        lines += [
            "| parameters | count |",
            "|---|---|",
            f"| total | {counts.total:,} |",
            f"| non-embedding | {counts.non_embedding:,} |",
            f"| active per token | {counts.active:,} |",
            f"| embedding | {counts.tok_emb + counts.pos_emb:,} |",
            "",
        ]
    else:
        lines += ["Parameter counts: not known (the run's config has no model section).", ""]
    summary = {
        k: run_cfg[k]
        for k in ("objective", "finetune", "init_from", "seed")
        if run_cfg.get(k) not in (None, "", {}) and not isinstance(run_cfg.get(k), dict)
    }
    trainer = run_cfg.get("trainer") or {}
    summary.update(
        {
            f"trainer.{k}": trainer[k]
            for k in ("max_steps", "batch_size", "seq_len", "precision")
            if k in trainer
        }
    )
    optim = run_cfg.get("optim") or {}
    summary.update({f"optim.{k}": optim[k] for k in ("name", "lr", "min_lr", "warmup_steps") if k in optim})
    # the model's fields that are set (None: not used)
    shown_model = {k: v for k, v in model.items() if v is not None}
    lines += ["## Config", "", "```yaml", yaml.safe_dump({"model": shown_model}, sort_keys=False).strip()]
    if summary:
        lines.append(yaml.safe_dump(summary, sort_keys=False).strip())
    lines += ["```", "", "The whole config is the run's `config.yaml`.", "", "## Data", ""]
    if manifest:
        source = manifest.get("source") or {}
        lines += [
            f"- kind: `{source.get('kind')}`",
            f"- source: {source.get('description')}",
            f"- content sha256: `{source.get('sha256')}`",
        ]
        for h in source.get("hub") or []:
            subset = f", subset {h['subset']}" if h.get("subset") else ""
            asked = f" (asked: {h['revision']})" if h.get("revision") else ""
            lines.append(
                f"- Hub dataset [{h['repo']}](https://huggingface.co/datasets/{h['repo']}) at commit "
                f"`{h['commit']}`{asked}, split {h['split']}{subset}: {', '.join(h.get('files') or [])}"
            )
        tok = manifest.get("tokenizer") or {}
        if tok:
            lines.append(f"- tokenizer: {tok.get('kind')} ({tok.get('vocab_size', '?')} tokens)")
        for split, c in (manifest.get("splits") or {}).items():
            if isinstance(c, dict):
                shown = ", ".join(
                    f"{v:,} {k}" for k, v in c.items() if isinstance(v, int) and not isinstance(v, bool)
                )
                lines.append(f"- {split}: {shown}")
        lines.append("")
    else:
        lines += ["The run folder has no data manifest (manifest.json).", ""]
    lines += ["## Evaluation", ""]
    if evals:
        lines += ["| task | metric | value | stderr | n |", "|---|---|---|---|---|"]
        for r in evals:
            cells = [r["task"], r["metric"], _fmt(r["value"]), _fmt(r.get("stderr")), _fmt(r.get("n"))]
            lines.append(f"| {' | '.join(map(str, cells))} |")
        lines.append("")
    else:
        lines += ["No eval results in the run folder (`gptkit eval run=... tasks=...` writes them).", ""]
    lines += ["## Export parity", "", parity, "", "## Files", "", "| file | size |", "|---|---|"]
    lines += [f"| {n} | {_size(b)} |" for n, b in export_files(out)]
    return "\n".join(lines) + "\n"
