"""A data config as a complete plain dict: its kind's defaults (conf/data/<kind>.yaml, the one place they are
written) under the given keys.

    settings({"kind": "files", "paths": ["a.txt"]})   # the same dict, and cache key, as data=files in YAML

WINDOW_KEYS and BUILD_KEYS change no token (how windows are drawn from shards, how shards are built): they
are no part of a token-shard cache key (shard_settings leaves them out). special_tokens_in_content is part of
a cache key only where it changes the ids (keyed_special_text).
"""

from __future__ import annotations

from typing import Any, Callable

from gptkit.conf_files import conf_dir, preset_defaults
from gptkit.errors import GptkitError

# data options of how windows are drawn from the shards: they change no token
WINDOW_KEYS = ("pack",)
# data.pack: what a window's documents may see (gptkit/data/windows.py). Here, not in windows.py, which
# imports torch: sample, chat and serve read this module before they look for their run (torch was most of
# the 3.3 s of CPU that `sample run=runs/none` cost, issue 47 item 12)
PACKS = ("stream", "documents")
# data options of how the shards are built: they change no token either
BUILD_KEYS = ("workers",)
# data.special_tokens_in_content: text (a special token that the data's text spells stays text: only the
# template's markup and the EOS / BOS put between documents are special ids) | allow (it becomes the control
# token, as gptkit did before this setting)
SPECIAL_TEXT_KEY = "special_tokens_in_content"
SPECIAL_TEXT = ("text", "allow")


def plain(cfg: Any) -> dict[str, Any]:
    """A DictConfig (resolved) or a mapping as a plain dict."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def kind_names() -> list[str]:
    """The data kinds a config can name: the presets of conf/data/."""
    return sorted(p.stem for p in (conf_dir() / "data").glob("*.yaml"))


def defaults(kind: Any) -> dict[str, Any]:
    """The defaults of data kind `kind` (a one-line error for an unknown kind)."""
    found = preset_defaults("data", str(kind)) if isinstance(kind, str) else None
    if found is None:
        raise GptkitError(f"unknown data kind {kind!r}; use data={'|'.join(kind_names())}")
    return found


def settings(cfg: Any) -> dict[str, Any]:
    """The data config as a complete plain dict: {"kind", the kind's defaults, the given keys}."""
    d = plain(cfg)
    return {"kind": d.get("kind"), **defaults(d.get("kind")), **d}


def shard_settings(s: dict[str, Any]) -> dict[str, Any]:
    """Complete settings of a token-stream kind without WINDOW_KEYS and BUILD_KEYS: what its cache key and
    manifest hold. data.pack is checked here, before anything is built."""
    pack = s.get("pack", "stream")
    if pack not in PACKS:
        raise GptkitError(f"data.pack={pack!r} is not one of {', '.join(PACKS)}")
    return {k: v for k, v in s.items() if k not in (*WINDOW_KEYS, *BUILD_KEYS)}


def build_workers(s: Any) -> int | None:
    """data.workers: the tokenization processes (None: every core this process may use, fewer for a small
    corpus)."""
    w = s.get("workers") if hasattr(s, "get") else None
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise GptkitError(f"data.workers={w!r} must be an integer >= 1 (or null for every usable core)")
    return w


def for_model(cfg: Any, position: str) -> dict[str, Any]:
    """data.bos=auto for the model that trains on it: a model family that wants a BOS (Llama-style, RoPE
    positions) keeps auto (the tokenizer's own BOS if it has one); a GPT-2-style model (learned positions)
    gets false. Every source of a data=mix likewise (a source without bos is auto). Kinds without a bos
    setting, and other values, stay as they are."""
    data = plain(cfg)
    if position == "rope":
        return data
    if isinstance(data.get("sources"), dict):
        sources = {}
        for n, s in data["sources"].items():
            if isinstance(s, dict) and isinstance(s.get("kind"), str):
                own = {k: v for k, v in (preset_defaults("data", s["kind"]) or {}).items()}
                own = {k: v for k, v in own.items() if k not in (*WINDOW_KEYS, *BUILD_KEYS)}
                s = for_model({"kind": s["kind"], **own, **s}, position)
            sources[n] = s
        return {**data, "sources": sources}
    return {**data, "bos": False} if data.get("bos") == "auto" else data


def allows_special_text(s: dict[str, Any]) -> bool:
    """data.special_tokens_in_content, checked: True for allow (spelled special tokens become control
    tokens), False for text (the default)."""
    v = s.get(SPECIAL_TEXT_KEY, "text")
    if v not in SPECIAL_TEXT:
        raise GptkitError(
            f"data.{SPECIAL_TEXT_KEY}={v!r} must be text (special tokens that the data spells stay text) or "
            "allow (they become control tokens, as before)"
        )
    return v == "allow"


def keyed_special_text(s: dict[str, Any], spelled: Callable[[], bool]) -> dict[str, Any]:
    """The settings as a cache key holds them: special_tokens_in_content only where it makes other ids than
    every gptkit before it made (text, on data that may spell a special token: spelled(), called only
    then). allow, and data that spells none, keep the key they had, and so their prepared folders."""
    if SPECIAL_TEXT_KEY not in s or (not allows_special_text(s) and spelled()):
        return s
    return {k: v for k, v in s.items() if k != SPECIAL_TEXT_KEY}
