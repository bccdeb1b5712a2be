"""The model-family seam of gptkit.hf: one interface (Family) and the data every family may read.

A family is one transformers model_type (LlamaForCausalLM's llama, ..., GPT-2's gpt2) and says, for the
conversion code (convert.py) that never asks which family it holds:

    claims(cfg)            whether a gptkit ModelConfig has its layout (the first family of
                           families.FAMILIES that claims a config is its family)
    check(cfg)             GptkitError naming the first field that does not map; None when all do
    config_to_hf(cfg)      its config.json keys (the keys every family writes are convert.py's)
    check_hf(d)            config.json's numbers sane before anything is sized by them
    config_from_hf(d)      the ModelConfig of its config.json, or a GptkitError
    embedding_rows, layer_rows(cfg, i), final_rows
                           the weight names: (ours, theirs, how) rows, how: COPY, TRANSPOSE, SPLIT, STACK,
                           JOIN, WEAVE, GATE_SPLIT
    files_layout, memory_layout, check_files
                           the files' layout against transformers' in-memory one (the mixtures' experts)

    gguf_arch, gguf_refused, gguf_check(cfg), gguf_keys(cfg), gguf_state(state, cfg)
                           llama.cpp's reading of it (`export format=gguf`: gguf_file.py): its architecture
                           ("" : none, gguf_refused says why), the variants it cannot run, its own
                           metadata keys, and the transformers tensors as llama.cpp lays them out

    unpack(state, d, source)
                           the files' tensors with what config.json's quantization_config packs read back,
                           and a note saying so (gpt-oss's MXFP4 experts)

A family is a file (llama.py, gemma.py, moe.py, gpt2.py, smollm3.py: one file per family group) and one row of
families.FAMILIES. Families read this leaf and decoder.py (the RoPE decoder layout the Llama-style families
share), never each other.
"""

from __future__ import annotations

from typing import Any

from gptkit.errors import GptkitError
from gptkit.model.config import ModelConfig

# how one of our tensors becomes theirs: the same tensor; GPT-2's Conv1D stores [in, out]; our fused qkv_proj
# rows are q_proj, k_proj, v_proj in that order; our [E, out, in] experts tensor is their E tensors; our
# tensors (a tuple: gate_proj, up_proj) are the equal row blocks of their one tensor, in that order (Phi-3's
# gate_up_proj); our two tensors (a tuple) are the even and odd entries of their one tensor's last axis, each
# of ours a [E, out, in] stack transposed to [E, in, out] first (gpt-oss's interleaved gate_up_proj and its
# bias); our fused qkv_proj and the output gate's gate_proj (a tuple) are their q_proj, k_proj, v_proj, each
# query head's q_proj rows its query's head_dim rows then its gate's (Qwen3-Next's gated q_proj: GATE_SPLIT).
# TRANSPOSE swaps the last two axes (a [E, out, in] stack's too).
COPY, TRANSPOSE, SPLIT, STACK, JOIN, WEAVE = "copy", "transpose", "split", "stack", "join", "weave"
GATE_SPLIT = "gate_split"
Row = tuple[str | tuple[str, ...], str | tuple[str, ...], str]
# the fields only some families turn on (Gemma's), at the values every other family needs
PLAIN = {
    "scale_embeddings": False,
    "attn_softcap": None,
    "logit_softcap": None,
    "attn_sinks": False,
    "attn_output_gate": False,
    "rope_local_theta": None,
    # every layer rotates (SmolLM3's NoPE layers: gptkit/hf/smollm3.py)
    "nope_layers": None,
    # every family of today is multi-head attention (gptkit/model/attention_kinds.py)
    "attention_kind": "mha",
    # RoPE over the whole head (Phi-3's partial RoPE: gptkit/hf/phi3.py)
    "rotary_dim": None,
    # no multi-token prediction modules (DeepSeek-V3's and GLM-4.5's keep theirs: their family files)
    "mtp": None,
    # no linear-attention layers (Gated DeltaNet: model.gdn is set exactly when some layer is linear)
    "gdn": None,
}


def require(cfg: ModelConfig, need: dict[str, Any], where: str, target: str) -> None:
    """GptkitError naming the first field of `need` that cfg does not have: `target` (a transformers
    architecture, said for a reader) needs it."""
    for name, want in need.items():
        have = getattr(cfg, name)
        if have != want:
            raise GptkitError(
                f"model.{name}={have} {where} has no faithful transformers architecture: {target} needs "
                f"{name}={want}; refusing rather than produce a different model"
            )


def refusal(mtype: str):
    """refuse(field, value, want) -> the GptkitError for a config.json value gptkit cannot represent."""

    def refuse(field: str, value: Any, want: str) -> GptkitError:
        return GptkitError(f"{mtype} config has {field}={value!r}, which gptkit cannot represent ({want})")

    return refuse


def whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_int(d: dict[str, Any], mtype: str, field: str, least: int = 1) -> None:
    """config.json's `field` is an integer >= least: else one GptkitError line naming it."""
    v = d[field]
    if not whole(v) or v < least:
        what = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise GptkitError(f"{mtype} config.json has {field}={v!r}; it must be {what}")


class Family:
    """One transformers model_type; the defaults are those of a family without experts."""

    # transformers' model_type, its model and config classes, and the family as a reader names it
    model_type = ""
    architecture = ""
    config_class = ""
    # its transformers class with a score head (a reward model, model.score_head: *ForSequenceClassification
    # with num_labels 1); "" where gptkit writes none (export refuses such a model in one line)
    score_architecture = ""
    title = ""
    # model_types near this one that gptkit does not read, and what to import instead
    refused_types: dict[str, str] = {}
    # the embedding weight's name in the files, the layers' prefix, config.json's (layers, hidden, vocab)
    embedding = "model.embed_tokens.weight"
    layer_prefix = "model.layers."
    size_fields = ("num_hidden_layers", "hidden_size", "vocab_size")
    # PEFT: the adapted linears are Conv1D ([in, out])
    fan_in_fan_out = False
    # transformers' model has dropout in attention only (export says so when model.dropout > 0)
    attention_dropout_only = True
    # a LoRA run's adapters export in PEFT's layout (gptkit/hf/peft.py); False: only merged
    peft_adapters = True
    # its files name the tensors its own way even when another family claims the config it reads (Phi-3's
    # fused weights, for a model of the Llama layout): import reads them by config.json's model_type
    own_files = False
    # it takes a longrope scaling: its transformers model computes every key again when a sequence outgrows
    # the original context (Phi-3's generate), as gptkit's decoding does; the others' would not (refused)
    longrope = False

    # llama.cpp's architecture (gguf-py's MODEL_ARCH, lower case) for `export format=gguf`; "": none, and
    # gguf_refused says why in the refusal
    gguf_arch = ""
    gguf_refused = "gptkit maps no llama.cpp architecture to it (none checked against llama.cpp's own)"
    # the model.rope_scaling types its GGUF file carries (llama: llama3's factors as the rope_freqs tensor)
    gguf_rope_scalings: tuple[str, ...] = ()

    def claims(self, cfg: ModelConfig) -> bool:
        raise NotImplementedError

    def gguf_check(self, cfg: ModelConfig) -> None:
        """GptkitError naming a variant of the family llama.cpp's architecture does not run; None when it
        runs every one."""

    def gguf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        """GGUF metadata keys of the architecture beyond those every one reads (without the "<arch>."
        prefix): {"attn_logit_softcapping": 50.0}."""
        return {}

    def gguf_state(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """A transformers state dict as llama.cpp reads it, under names gguf-py's TensorNameMap knows (the
        transformers ones, or its converter's: a mixture's experts stacked)."""
        return state

    def check(self, cfg: ModelConfig) -> None:
        raise NotImplementedError

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        raise NotImplementedError

    def check_hf(self, d: dict[str, Any]) -> None:
        raise NotImplementedError

    def config_from_hf(self, d: dict[str, Any], name: str) -> ModelConfig:
        raise NotImplementedError

    def text_config(self, d: dict[str, Any]) -> dict[str, Any]:
        """The language model's config.json keys of `d` (a checkpoint with a vision tower keeps them in
        text_config: Qwen3.5's)."""
        return d

    def size(self, d: dict[str, Any], field: str) -> int:
        """config.json's size field (check_hf passed)."""
        return d[field]

    def file_names(self, state: dict[str, Any]) -> dict[str, Any]:
        """A state dict (or its shapes) under the names name_map uses."""
        return state

    def check_head_shapes(self, d: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> None:
        """The heads config.json sets against the weights' shapes, where the shapes can tell."""

    def embedding_rows(self, cfg: ModelConfig) -> list[Row]:
        raise NotImplementedError

    def layer_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        raise NotImplementedError

    def final_rows(self, cfg: ModelConfig) -> list[Row]:
        raise NotImplementedError

    def files_layout(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """A transformers state dict as transformers holds it in memory, in the files' layout."""
        return state

    def memory_layout(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """A transformers state dict in the files' layout, as transformers holds it in memory."""
        return state

    def check_files(self, hf: dict[str, Any], cfg: ModelConfig, source: str) -> None:
        """What the files hold beyond the tensor names, checked against config.json."""

    def unpack(
        self, state: dict[str, Any], d: dict[str, Any], source: str
    ) -> tuple[dict[str, Any], str | None]:
        """The files' tensors `state` with what config.json `d` packs read back, and one line saying so (None:
        nothing packed; a family without a packed format reads its tensors as they are)."""
        return state, None

    def trailing_layers(self, d: dict[str, Any]) -> int:
        """How many layers config.json `d` says the files may hold after its last one (GLM-4.5's MTP layers),
        which the layer count leaves out."""
        return 0

    def with_files(
        self, cfg: ModelConfig, d: dict[str, Any], state: dict[str, Any], source: str
    ) -> tuple[ModelConfig, str | None]:
        """(cfg as the files' tensors complete it, one note line for the importer or None): what config.json
        alone cannot say (GLM-4.5's MTP layers kept or dropped)."""
        return cfg, None
