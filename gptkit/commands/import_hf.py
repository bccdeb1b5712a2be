"""Read a local Hugging Face `transformers` folder (Llama or GPT-2) into a gptkit run folder
(config.yaml, tokenizer.json, checkpoints/last.ckpt) that sample, eval and export accept.

Weights are read from model.safetensors (single or sharded); pytorch_model.bin only with
torch.load(weights_only=True), so a pickle that would run code is refused. The weights are
kept exactly (stored in fp32; a bf16/fp16 source is widened without rounding).

Examples:
  gptkit import hf=/models/TinyLlama-1.1B out=runs/tinyllama
  gptkit import hf=/models/gpt2 out=runs/gpt2 force=true
"""

from __future__ import annotations


def run(cfg) -> int:
    import json
    import sys
    from pathlib import Path

    from gptkit import hf
    from gptkit.errors import ConfigError
    from gptkit.fsio import check_out_dir, staged_dir
    from gptkit.model import GPT
    from gptkit.runs import load_tokenizer, write_run_folder

    if not cfg.hf:
        raise ConfigError("import needs hf=<local transformers model folder>")
    if not cfg.out:
        raise ConfigError("import needs out=<run folder to write>")
    hf_dir = Path(cfg.hf).expanduser()
    out = check_out_dir(Path(cfg.out).expanduser(), bool(cfg.force))  # fail before the slow part
    hf_cfg = hf.read_hf_config(hf_dir)
    model_cfg = hf.model_config_from_hf(hf_cfg, name=cfg.name or hf_dir.resolve().name)
    source = hf.load_weights(hf_dir)
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in source.values()})
    model = GPT.from_state(model_cfg, hf.from_hf_state_dict(source, model_cfg, source=str(hf_dir)))
    tokenizer = load_tokenizer(hf_dir) if (hf_dir / "tokenizer.json").is_file() else None
    with staged_dir(out, force=bool(cfg.force)) as tmp:
        write_run_folder(tmp, {}, model, tokenizer)
        provenance = {"source": str(hf_dir.resolve()), "architectures": hf_cfg.get("architectures"),
                      "model_type": hf_cfg.get("model_type"), "dtypes": dtypes}
        (tmp / "imported_from.json").write_text(json.dumps(provenance, indent=2))

    print(f"imported {hf_dir} ({hf_cfg.get('model_type')}, {model.num_parameters():,} parameters, "
          f"{'/'.join(dtypes)} -> fp32) into {out}")
    print(f"  attention heads: {hf.heads_confirmed(hf_cfg, model_cfg)}")
    if tokenizer is None:
        print(f"warning: {hf_dir} has no tokenizer.json, so {out} has no tokenizer and `gptkit sample` will "
              f"refuse it; save the fast tokenizer there (AutoTokenizer.from_pretrained(...).save_pretrained) "
              f"and import again", file=sys.stderr)
    return 0
