"""Read a Hugging Face `transformers` model of a family listed above into a gptkit run folder (config.yaml,
tokenizer.json, checkpoints/last.ckpt) that sample, eval, export and `train init_from=` accept.

hf= is a local folder (it wins whenever it exists) or a Hugging Face Hub model id, owner/name[@revision]:
then config.json and tokenizer.json, and then the safetensors weights, are downloaded into the Hugging Face
cache (HF_HOME), with progress bars. Offline (HF_HUB_OFFLINE=1, or the hub unreachable) a model already in
that cache still imports; any other fails at once.

Weights are read from model.safetensors (single or sharded); pytorch_model.bin only with
torch.load(weights_only=True), so a pickle that would run code is refused. The weights are
kept exactly (stored in fp32; a bf16/fp16 source is widened without rounding).

Examples:
  gptkit import hf=openai-community/gpt2 out=runs/gpt2
  gptkit import hf=TinyLlama/TinyLlama-1.1B-Chat-v1.0@main out=runs/tinyllama
  gptkit import hf=/models/gpt2 out=runs/gpt2 force=true
"""

from __future__ import annotations

import sys
from pathlib import Path

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def prepare_args(args: list[str]) -> list[str]:
    """hf=s3://... (a folder `gptkit export out=s3://...` published): downloaded and checked first."""
    from gptkit.remote import localize_args

    return localize_args(args, {"hf": "folder"})


def run(cfg) -> int:
    from gptkit.errors import ConfigError
    from gptkit.fsio import check_out_dir
    from gptkit.hf import folders
    from gptkit.runs import check_import_out

    if not cfg.hf:
        raise ConfigError("import needs hf=<local transformers model folder or Hub model id owner/name>")
    if not cfg.out:
        raise ConfigError("import needs out=<run folder to write>")
    # fail before the slow part (a download)
    out = check_out_dir(Path(cfg.out).expanduser(), bool(cfg.force))
    # never a run with training in it, nor one held by a process
    check_import_out(out, None, bool(cfg.force))
    src = folders.locate(str(cfg.hf))
    if src.note:
        print(f"note: {src.note}", file=sys.stderr)
    done = folders.import_folder(src, out, force=bool(cfg.force), name=cfg.name)

    # a Hub model: owner/name@commit
    shown = cfg.hf if src.spec == str(src.dir.resolve()) else src.spec
    print(
        f"imported {shown} ({done.model_type}, {done.n_params:,} parameters, {'/'.join(done.dtypes)} -> "
        f"fp32) into {out}"
    )
    print(f"  attention heads: {done.heads}")
    for note in done.notes or []:
        print(f"note: {note}", file=sys.stderr)
    if done.has_chat_template:
        print(
            f"  chat template: kept in {out / 'chat.json'} (gptkit chat run={out}; data=chat "
            f"data.template=auto)"
        )
    if not done.has_tokenizer:
        print(
            f"warning: {shown} has no tokenizer.json, so {out} has no tokenizer and `gptkit sample` will "
            f"refuse it; put one in {out} (AutoTokenizer.from_pretrained(...).save_pretrained(<folder>) "
            f"writes it)",
            file=sys.stderr,
        )
    return 0
