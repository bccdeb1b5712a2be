"""Write a run as a Hugging Face `transformers` folder: config.json, model.safetensors (sharded
above max_shard_size), tokenizer.json + tokenizer_config.json + special_tokens_map.json, and
generation_config.json. It loads with AutoModelForCausalLM / AutoTokenizer and no custom code.

A run with a chat template (trained with data=chat, or imported with one) exports it as
tokenizer_config.json's chat_template and chat_template.jinja, and generation_config.json's eos_token_id
lists the end-of-turn token before the end-of-text token, so transformers (and vLLM, llama.cpp) format a
conversation as it was trained and stop at the end of a turn.

Each model becomes the transformers architecture of its family: RoPE + SwiGLU + RMSNorm become Llama (with
a sliding window in every layer: Mistral; biases on q/k/v only: Qwen2; qk_norm=head: Qwen3; qk_norm=full
with post norms: OLMo-2), GeGLU with Gemma's norms Gemma 2 (no qk_norm) or Gemma 3 (qk_norm=head), a
mixture of experts Mixtral, Qwen3-MoE or OLMoE (by its qk_norm), and learned positions + GELU + LayerNorm
(with biases) GPT-2 (the mapping: docs/hf.md). Any other combination is refused, naming the variant that
does not map.

A LoRA run (finetune=lora) exports its base with the adapters merged (W + alpha/rank * B @ A); with
adapters=true, only the adapters, as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)
that PeftModel.from_pretrained loads on the base exported by itself (docs/lora.md). A QLoRA run
(finetune=qlora) merges them into the base it trained on, its block projections dequantized from NF4
(docs/qlora.md).

With push_to_hub=owner/name the export is uploaded to that Hub model repository (private unless
private=false) with a model card, README.md: the run's config, its parameter counts, its data manifest and the
data's provenance, the eval table of its results files, the export's parity check and the files
(gptkit/hf/card.py, docs/hub.md). The token is HF_TOKEN's (or HUGGING_FACE_HUB_TOKEN's), never printed; a push
without one, offline, or with the hub unreachable fails in one line before anything is written.

format=gguf writes model.gguf (llama.cpp's format, through gguf-py: the `gguf` extra) and an ollama
Modelfile instead, dtype= fp32 | fp16 | bf16 | q8_0, for the families llama.cpp reads (docs/gguf.md).

Examples:
  gptkit export run=runs/llama-tiny-20250101-120000 out=hf/llama-tiny
  gptkit export run=runs/my-run out=hf/my-run dtype=bf16 max_shard_size=2GB force=true
  gptkit export run=runs/my-lora-run out=hf/my-adapter adapters=true
  HF_TOKEN=... gptkit export run=runs/my-run out=hf/my-run push_to_hub=me/my-model license=apache-2.0
  gptkit export run=runs/my-run out=gguf/my-run format=gguf dtype=q8_0
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def prepare_args(args: list[str]) -> list[str]:
    """run=s3://... is downloaded (its newest complete checkpoint); out=s3://... is written in its staging
    folder, then uploaded (gptkit/remote.py)."""
    from gptkit.remote import localize_args

    return localize_args(args, {"run": "run", "out": "staging"})


def run(cfg) -> int:
    """The export (write), then, with push_to_hub=, its upload with a model card (checked before writing);
    an s3:// out= (its staging folder) published to the bucket (gptkit/remote.py)."""
    push = None
    if cfg.get("push_to_hub"):
        from gptkit.hf.push import check

        push = check(cfg.push_to_hub, cfg.get("private", True))
    code = write(cfg)
    if code == 0:
        publish_s3(cfg)
    if code == 0 and push is not None:
        push_export(cfg, push)
    return code


def publish_s3(cfg) -> None:
    """out= the staging folder of an s3:// location: uploaded with a manifest, COMPLETE last."""
    from gptkit.remote import publish_folder, remote_of

    out = Path(str(cfg.out)).expanduser()
    url = remote_of(out)
    if url is not None:
        publish_folder(out, url)
        print(f"published {url} (gptkit-remote.json, COMPLETE last)", file=sys.stderr)


def push_export(cfg, push) -> None:
    """The export at out= and its model card uploaded to push.repo_id (gptkit/hf/push.py, card.py)."""
    from gptkit.accounting import count_params
    from gptkit.checkpoints import run_dir_of
    from gptkit.evaluation.task_results import run_results
    from gptkit.hf import card
    from gptkit.hf.parity import export_parity
    from gptkit.model import ModelConfig
    from gptkit.precision import torch_dtype
    from gptkit.runs import MANIFEST_FILE, find_run_checkpoint, read_config

    out = Path(cfg.out).expanduser()
    ckpt = find_run_checkpoint(cfg.run)
    run_dir = Path(run_dir_of(ckpt))
    run_cfg = read_config(run_dir)
    counts = count_params(ModelConfig.from_dict(run_cfg["model"])) if run_cfg.get("model") else None
    manifest_file = run_dir / MANIFEST_FILE
    manifest = json.loads(manifest_file.read_text()) if manifest_file.is_file() else None
    kind = card.export_kind(out)
    if kind == "transformers" and not cfg.adapters:
        ok, parity = export_parity(ckpt, out, torch_dtype(cfg.dtype))
        parity = f"{'passed' if ok else 'FAILED'}: {parity}"
        if not ok:
            print(f"warning: the export's parity check failed ({parity}); pushed anyway", file=sys.stderr)
    elif kind == "adapters":
        parity = (
            "not measured for an adapter folder: its weights are the run's LoRA factors as PEFT names them "
            "(the merged export, adapters=false, is the one whose logits are checked)"
        )
    else:
        parity = f"not measured: gptkit checks the logits of transformers folders only ({kind} export)"
    text = card.model_card(
        out,
        push.repo_id,
        run_dir,
        run_cfg,
        counts,
        manifest,
        run_results(run_dir),
        parity,
        cfg.get("license"),
    )
    uploaded = push.upload(out, text)
    print(
        f"pushed {out} to {push.url} ({'private' if push.private else 'public'}): {len(uploaded)} files, "
        f"the model card README.md included"
    )


def write(cfg) -> int:
    from gptkit.checkpoints import run_dir_of
    from gptkit.errors import ConfigError
    from gptkit.fsio import check_out_dir
    from gptkit.runs import TOKENIZER_FILE, check_not_source, find_run_checkpoint, read_config

    if not cfg.run:
        raise ConfigError("export needs run=<run folder or checkpoint>")
    if not cfg.out:
        raise ConfigError("export needs out=<folder to write the transformers model into>")
    fmt = cfg.get("format", "hf")
    if fmt not in ("hf", "gguf"):
        raise ConfigError(f"export format={fmt!r}: choose hf (a transformers folder) or gguf (llama.cpp)")
    if fmt == "gguf":
        from gptkit.hf.gguf_file import check_type

        check_type(str(cfg.dtype))
        if cfg.adapters:
            raise ConfigError("export format=gguf writes the merged model; adapters=true is format=hf's")
    # the run is found before torch is imported (gptkit.hf.folders): a missing one costs 0.3 s, not 3 s
    ckpt = find_run_checkpoint(cfg.run)
    if fmt == "gguf":
        return export_gguf(ckpt, cfg)
    from gptkit import hf
    from gptkit.hf import folders
    from gptkit.model import ModelConfig
    from gptkit.precision import torch_dtype

    dtype = torch_dtype(cfg.dtype)
    max_shard = folders.parse_size(cfg.max_shard_size)
    out = Path(cfg.out).expanduser()
    check_not_source(out, run_dir_of(ckpt))
    # fail before the slow part
    out = check_out_dir(out, bool(cfg.force))
    # refuse before loading
    model_cfg = ModelConfig.from_dict(read_config(run_dir_of(ckpt))["model"])
    family = hf.family_of(model_cfg)
    # a reward model (model.score_head): its family's *ForSequenceClassification, or one line
    architecture = hf.architecture_class(model_cfg)
    if cfg.adapters:
        return export_adapters(ckpt, out, cfg)

    done = folders.export_folder(ckpt, out, dtype, max_shard, bool(cfg.force))
    qlora = read_config(run_dir_of(ckpt)).get("finetune") == "qlora"
    merged = " (QLoRA: its NF4 base dequantized, the adapters merged)" if qlora else ""
    print(
        f"exported {done.checkpoint}{merged} as "
        f"{architecture} ({done.n_params:,} parameters, {cfg.dtype}) to {out}: "
        f"config.json, {', '.join(done.weights)}, generation_config.json"
        + (
            ", tokenizer.json, tokenizer_config.json, special_tokens_map.json"
            if done.tokenizer is not None
            else ""
        )
        + (", chat_template.jinja" if done.template is not None else "")
    )
    if done.template is not None:
        ends = ", ".join(done.tokenizer.id_to_token(i) for i in done.stop_ids)
        print(
            f"  chat template {Path(done.template.name).name} (tokenizer_config.json's chat_template, "
            f"chat_template.jinja); generate() stops at {ends or 'max_new_tokens only'} "
            "(generation_config.json's eos_token_id)"
        )
    if done.tokenizer is None:
        print(
            f"warning: {done.run_dir / TOKENIZER_FILE} is missing, so {out} has no tokenizer files "
            f"(AutoTokenizer will not load it); copy the run's tokenizer.json there and export again",
            file=sys.stderr,
        )
    elif not done.has_eos:
        # a chat run's end of a turn is still a stop (generation_config.json's eos_token_id, said above)
        stops = "at the end of a turn or " if done.stop_ids else ""
        print(
            f"note: the tokenizer has no end-of-text token, so generate() will stop only {stops}at "
            "max_new_tokens",
            file=sys.stderr,
        )
    if family.attention_dropout_only and done.model_cfg.dropout > 0:
        print(
            f"note: {family.architecture} has attention dropout only, so "
            f"model.dropout={done.model_cfg.dropout} applies there and not to the residual stream when "
            f"fine-tuning in transformers (inference is unaffected)",
            file=sys.stderr,
        )
    return 0


def export_gguf(ckpt, cfg) -> int:
    """format=gguf: the run as model.gguf (llama.cpp) and an ollama Modelfile (gptkit.hf.gguf_file)."""
    from gptkit.checkpoints import run_dir_of
    from gptkit.extras import require
    from gptkit.fsio import check_out_dir
    from gptkit.hf.gguf_file import export_gguf as write
    from gptkit.hf.gguf_file import gguf_family
    from gptkit.model import ModelConfig
    from gptkit.runs import check_not_source, read_config

    require("gguf")
    out = Path(cfg.out).expanduser()
    check_not_source(out, run_dir_of(ckpt))
    out = check_out_dir(out, bool(cfg.force))
    # refuse before loading
    gguf_family(ModelConfig.from_dict(read_config(run_dir_of(ckpt))["model"]))
    done = write(ckpt, out, str(cfg.dtype), bool(cfg.force))
    print(
        f"exported {done.checkpoint} as llama.cpp's {done.arch} ({done.n_tensors} tensors, {done.dtype}; "
        f"tokenizer: {done.vocab.what}) to {done.path}, with an ollama Modelfile beside it"
    )
    if done.kept_f16:
        print(
            f"  {len(done.kept_f16)} tensors kept f16 (rows not whole blocks of 32 for q8_0): "
            f"{', '.join(done.kept_f16[:4])}{' ...' if len(done.kept_f16) > 4 else ''}"
        )
    if done.template is not None:
        print(
            f"  chat template {Path(done.template.name).name} (tokenizer.chat_template); end of turn "
            f"{', '.join(done.stop_tokens) or 'none'} (tokenizer.ggml.eot_token_id)"
        )
    return 0


def export_adapters(ckpt, out, cfg) -> int:
    """adapters=true: the LoRA run's adapters as a PEFT adapter folder (gptkit.hf.peft_adapters)."""
    from safetensors.torch import save_file

    from gptkit import adapters, hf
    from gptkit.checkpoints import load_checkpoint, lora_base, model_state_dict, run_dir_of
    from gptkit.errors import GptkitError
    from gptkit.fsio import staged_dir
    from gptkit.model import ModelConfig
    from gptkit.precision import torch_dtype
    from gptkit.runs import IMPORTED_FILE, read_config

    checkpoint = load_checkpoint(ckpt)
    if adapters.CHECKPOINT_KEY not in checkpoint:
        raise GptkitError(
            f"export adapters=true: {ckpt} is not a LoRA run's checkpoint (finetune=lora); "
            f"export its weights with adapters=false"
        )
    record = checkpoint[adapters.CHECKPOINT_KEY]
    model_cfg = ModelConfig.from_dict(read_config(run_dir_of(ckpt))["model"])
    state = model_state_dict(checkpoint)
    adapters.check_adapters(state, model_cfg, record, str(ckpt))
    # there and unchanged: the adapters fit it
    base_run = run_dir_of(lora_base(checkpoint, ckpt))
    imported = base_run / IMPORTED_FILE
    source = json.loads(imported.read_text()).get("source") if imported.is_file() else None
    config, tensors = hf.peft_adapters(state, model_cfg, record, str(source or base_run))
    dtype = torch_dtype(cfg.dtype)
    with staged_dir(out, force=bool(cfg.force)) as tmp:
        save_file(
            {k: v.to(dtype).contiguous() for k, v in tensors.items()},
            str(tmp / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    # the parameters training counted; PEFT's layout may store more values (zeros)
    # (a reward model's score head trains in full beside them: PEFT's modules_to_save)
    whole = adapters.whole_keys(model_cfg)
    n = adapters.adapter_params(model_cfg, record["targets"], record["rank"])
    n += sum(state[k].numel() for k in whole)
    stored = sum(v.numel() for v in tensors.values())
    layout = (
        f", stored as {stored:,} values: PEFT's adapter on GPT-2's fused c_attn holds zeros beside the "
        f"q, k, v blocks"
        if stored != n
        else ""
    )
    # finetune=qlora: what they trained on
    quantized = record.get("quantized")
    on_nf4 = (
        f"; they trained on the NF4-quantized base (blocks of {quantized['block_size']}): on the "
        f"full-precision base their outputs differ by the quantization error, the merged export "
        f"(adapters=false) holds the dequantized base they trained on"
        if quantized
        else ""
    )
    print(
        f"exported the LoRA adapters of {ckpt} (rank {record['rank']}, alpha {record['alpha']}, "
        f"{', '.join(record['targets'])}{' and the score head, modules_to_save' if whole else ''}; "
        f"{n:,} trainable parameters{layout}, {cfg.dtype}) to {Path(out)}: "
        f"adapter_config.json, adapter_model.safetensors, for PEFT on the base {source or base_run} "
        f"(export it with: gptkit export run={base_run} out=<folder>){on_nf4}"
    )
    return 0
