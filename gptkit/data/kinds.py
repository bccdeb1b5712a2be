"""Every data kind in one table, and the one call that prepares any of them.

    prepared = prepare(cfg.data, cfg.tokenizer)    # -> a Prepared (gptkit/data/face.py), cached

kind         prepared by                          its prepared form
pydoc        build.prepare_corpus (sources.pydoc) token shards (PreparedData) of the opened text
shakespeare  build.prepare_corpus (...shakespeare) token shards
stdlib       build.prepare_corpus (sources.stdlib) token shards
files        build.prepare_corpus (.local_files)  token shards
hub          build.prepare_corpus (sources.hub)   token shards
tokens       tokenfiles.prepare_tokens            token shards, copied from token files made elsewhere
prepared     prepared.use_prepared                token shards a `gptkit prepare` wrote
mix          mixture.prepare_mix                  a MixedData of token-shard sources (mixable kinds)
chat         templated(chat.KIND)                 conversations (ChatData)
preference   templated(preference.KIND)           preference pairs (PreferenceData)
prompts      templated(prompts.KIND)              prompts and their records, for RL (PromptData)
unpaired     templated(unpaired.KIND)             labelled completions, for KTO (UnpairedData)

Each kind receives its complete settings (gptkit.data.settings: the defaults of conf/data/<kind>.yaml
under the given keys), the tokenizer resolved once (a TokenizerSpec) and the BuildOptions (cache folder,
progress, force). A new kind is a module with its Prepared subclass and prepare function (or, for a text
kind, only its Corpus opener: text(opener); for a templated kind, its TemplatedKind: templated(KIND)), a
preset in conf/data/, and one row here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gptkit.data import build, chat, mixture, preference, prepared, prompts, sources, tokenfiles, unpaired
from gptkit.data.cache import cache_root
from gptkit.data.face import BuildOptions, Prepared
from gptkit.data.settings import kind_names, plain, settings
from gptkit.data.sources import Corpus
from gptkit.data.templated import TemplatedKind
from gptkit.errors import GptkitError
from gptkit.tokenizer import TokenizerSpec, tokenizer_spec


@dataclass(frozen=True)
class Kind:
    """One data kind: what prepares it, and the facts other rooms ask of it.

    prepare   (complete settings, TokenizerSpec, BuildOptions) -> Prepared
    corpus    a text kind's opener, (complete settings) -> Corpus (gptkit/data/sources.py): its text as
              bounded pieces, which prepare_corpus tokenizes and a mixture trains a shared tokenizer on
    mixable   its data is one token stream: a data=mix may hold it
    scored    None: `gptkit eval` scores windows of its tokens; else why it cannot (one line)"""

    prepare: Callable[[dict[str, Any], TokenizerSpec, BuildOptions], Prepared]
    corpus: Callable[[dict[str, Any]], Corpus] | None = None
    mixable: bool = False
    scored: str | None = None


def text(opener: Callable[[dict[str, Any]], Corpus]) -> Kind:
    """The row of a text kind: its text opened by `opener`, tokenized into shards by prepare_corpus."""
    return Kind(functools.partial(build.prepare_corpus, open_corpus=opener), corpus=opener, mixable=True)


def templated(kind: TemplatedKind, scored: str | None = None) -> Kind:
    """The row of a templated kind (records rendered with a chat template: gptkit/data/templated.py), which
    `gptkit eval` cannot score (`scored`: why, its NOT_SCORED)."""
    return Kind(kind.prepare, scored=scored)


def open_corpus(s: dict[str, Any]) -> Corpus | None:
    """The text of a (complete) data config of a text kind; None for kinds that hold token ids."""
    kind = kind_of(s)
    return None if kind.corpus is None else kind.corpus(settings(s))


def _prepare_source(s: dict[str, Any], tok: TokenizerSpec, opts: BuildOptions) -> Prepared:
    """One source of a mixture: a mixable kind, prepared by its own row."""
    return KINDS[s["kind"]].prepare(s, tok, opts)


KINDS: dict[str, Kind] = {
    "pydoc": text(sources.pydoc),
    "shakespeare": text(sources.shakespeare),
    "stdlib": text(sources.stdlib),
    "files": text(sources.local_files),
    "hub": text(sources.hub),
    "tokens": Kind(tokenfiles.prepare_tokens, mixable=True),
    "prepared": Kind(prepared.use_prepared, mixable=True),
    "chat": templated(chat.KIND, chat.NOT_SCORED),
    "preference": templated(preference.KIND, preference.NOT_SCORED),
    "prompts": templated(prompts.KIND, prompts.NOT_SCORED),
    "unpaired": templated(unpaired.KIND, unpaired.NOT_SCORED),
}
# the kinds a data=mix may hold
MIXABLE = tuple(k for k, kind in KINDS.items() if kind.mixable)
KINDS["mix"] = Kind(
    functools.partial(
        mixture.prepare_mix, prepare_source=_prepare_source, open_source=open_corpus, mixable=MIXABLE
    )
)


def kind_of(data_cfg: Any) -> Kind:
    """The table row of a data config's kind (a one-line error for an unknown kind)."""
    name = plain(data_cfg).get("kind")
    if name not in KINDS:
        raise GptkitError(f"unknown data kind {name!r}; use data={'|'.join(kind_names())}")
    return KINDS[name]


def prepare(
    data_cfg: Any,
    tokenizer_cfg: Any,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    force: bool = False,
    max_seq_len: int | None = None,
) -> Prepared:
    """The data of a config, prepared for training: from the cache when present, else built now (a build a
    killed prepare left is continued). The tokenizer config is resolved here, once, for every kind.
    max_seq_len: the model's context, when known (no row of a run is longer than max_seq_len + 1 tokens)."""
    kind = kind_of(data_cfg)
    row_limit = int(max_seq_len) + 1 if max_seq_len is not None else None
    opts = BuildOptions(cache_root(cache_dir), bool(progress), bool(force), row_limit)
    return kind.prepare(settings(data_cfg), tokenizer_spec(tokenizer_cfg), opts)


def check_scored(data_cfg: Any) -> None:
    """`gptkit eval` scores windows of a token stream: a kind that is not one is a one-line error saying
    why (and what to pass instead), before anything is prepared."""
    why = kind_of(data_cfg).scored
    if why is not None:
        raise GptkitError(why)
