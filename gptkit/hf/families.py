"""The table of model families: every transformers model_type gptkit reads and writes, one row each.

The first family that claims a config is its family: a family stands before those whose configs it
narrows (gpt-oss before the other mixtures; the mixtures, Gemma, SmolLM3 and Phi-3 before the Llama layout,
Llama last of the RoPE families). A new family is a file beside these (a Family subclass:
gptkit/hf/family.py) and one row here.
"""

from __future__ import annotations

from gptkit.errors import GptkitError
from gptkit.hf.deepseek_v3 import DeepseekV2, DeepseekV3
from gptkit.hf.family import Family
from gptkit.hf.gemma import Gemma2, Gemma3
from gptkit.hf.glm4_moe import Glm4Moe
from gptkit.hf.gpt2 import GPT2
from gptkit.hf.gpt_oss import GptOss
from gptkit.hf.llama import Llama, Mistral, Olmo2, Qwen2, Qwen3
from gptkit.hf.moe import Mixtral, Olmoe, Qwen3Moe
from gptkit.hf.olmo3 import Olmo3
from gptkit.hf.phi3 import Phi3
from gptkit.hf.qwen3_next import Qwen3_5, Qwen3_5Moe, Qwen3_5MoeVision, Qwen3_5Vision, Qwen3Next
from gptkit.hf.smollm3 import SmolLM3
from gptkit.model.config import ModelConfig

FAMILIES: tuple[Family, ...] = (
    # Gated DeltaNet with its projections held apart (model.gdn.layout=split): Qwen3.5's alone
    Qwen3_5Moe(),
    Qwen3_5(),
    # Gated DeltaNet layers, the attention output gate, the gated shared expert: Qwen3-Next's alone
    Qwen3Next(),
    # multi-head latent attention: they alone claim attention_kind=mla
    DeepseekV2(),
    DeepseekV3(),
    GptOss(),
    # a sigmoid router: before the softmax mixtures, which claim by qk_norm alone
    Glm4Moe(),
    Mixtral(),
    Qwen3Moe(),
    Olmoe(),
    Gemma2(),
    Gemma3(),
    SmolLM3(),
    Phi3(),
    Qwen2(),
    Qwen3(),
    Olmo3(),
    Olmo2(),
    Mistral(),
    Llama(),
    GPT2(),
)
# the checkpoints import reads a language model of, which export writes as its text family (Qwen3.5's with
# its vision tower: Qwen3_5ForCausalLM)
READ_ONLY: tuple[Family, ...] = (Qwen3_5Vision(), Qwen3_5MoeVision())
BY_TYPE = {f.model_type: f for f in FAMILIES + READ_ONLY}
# transformers' model_type -> its model class and config class
ARCHITECTURES = {f.model_type: f.architecture for f in FAMILIES}
CONFIG_CLASSES = {f.model_type: f.config_class for f in FAMILIES}
# the *ForSequenceClassification classes a reward model (model.score_head) exports as
SCORE_ARCHITECTURES = tuple(f.score_architecture for f in FAMILIES if f.score_architecture)


def family_of(cfg: ModelConfig) -> Family:
    """The family of a mappable config; GptkitError naming the first variant that does not map."""
    family = next((f for f in FAMILIES if f.claims(cfg)), None)
    if family is None:
        raise GptkitError(
            f"model.position={cfg.position} with qk_norm={cfg.qk_norm} has no faithful transformers "
            f"architecture (gptkit writes {', '.join(ARCHITECTURES.values())}); refusing rather than "
            f"produce a different model"
        )
    family.check(cfg)
    if cfg.rope_scaling is not None and cfg.rope_scaling["type"] == "longrope" and not family.longrope:
        raise GptkitError(
            f"model.rope_scaling type longrope has no faithful transformers architecture for this model (it "
            f"would be {family.architecture}, whose generate keeps the keys cached before the switch to the "
            f"long factors): only Phi3ForCausalLM (no biases, no qk_norm) takes it; refusing rather than "
            f"produce a different model"
        )
    return family


def family_named(model_type: str) -> Family | None:
    """The family of a config.json's model_type, None when gptkit does not read it."""
    return BY_TYPE.get(model_type)


def imported(last: str = "and") -> str:
    """The families gptkit reads and writes as a reader names them, alphabetically: "GPT-2, ... and Qwen3-MoE"
    (the helps' list: gptkit/cli.py)."""
    titles = sorted((f.title for f in FAMILIES), key=str.lower)
    return f"{', '.join(titles[:-1])} {last} {titles[-1]}"
