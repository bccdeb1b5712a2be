"""Serve a run over HTTP with the OpenAI API: POST /v1/chat/completions (the run's chat template),
POST /v1/completions, GET /v1/models, GET /health, and a chat page at /. Every active request decodes in one
batch (continuous batching, up to max_batch); streaming answers are server-sent events. The official
`openai` client, curl, LangChain or Open WebUI connect to http://<host>:<port>/v1 (docs/serve.md).

Examples:
  gptkit serve run=runs/sft
  gptkit serve run=runs/sft port=0 max_batch=32
  gptkit serve run=runs/sft quantize=int8      # weight-only int8 through torchao (gptkit[quant])
  GPTKIT_API_KEY=secret gptkit serve run=runs/sft host=0.0.0.0 port=8080

Needs the `serve` extra (Starlette and uvicorn): pip install 'gptkit[serve]'; quantize= needs the `quant`
extra: pip install 'gptkit[quant]'.
"""

from __future__ import annotations

import os

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).

API_KEY_ENV = "GPTKIT_API_KEY"


def run(cfg) -> int:
    from gptkit.extras import require

    # before the server's modules import them: a missing one is the line that names the extra
    require("serve")
    from gptkit.data.settings import SPECIAL_TEXT
    from gptkit.errors import ConfigError
    from gptkit.runs import find_run_checkpoint, resolve_device
    from gptkit.threads import set_threads

    if cfg.special_tokens_in_content not in SPECIAL_TEXT:
        raise ConfigError(
            f"special_tokens_in_content={cfg.special_tokens_in_content!r} must be text (a special token a "
            "message spells stays text) or allow (it becomes the control token)"
        )
    ints = (("port", 0), ("max_batch", 1), ("max_queue", 0), ("max_request_bytes", 1))
    nullable = tuple(
        (key, 1) for key in ("block_size", "kv_blocks", "max_step_tokens") if cfg[key] is not None
    )
    for key, low in ints + nullable:
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{key}={value!r} must be an integer >= {low}")
    if (
        isinstance(cfg.limit_concurrency, bool)
        or not isinstance(cfg.limit_concurrency, int)
        or cfg.limit_concurrency < 1
    ):
        raise ConfigError(f"limit_concurrency={cfg.limit_concurrency!r} must be an integer >= 1")
    timeout = cfg.request_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"request_timeout={timeout!r} must be a number of seconds > 0")
    hosts = cfg.allowed_hosts
    if isinstance(hosts, str):
        hosts = [hosts]
    if hosts is None or not all(isinstance(h, str) and h.strip() for h in hosts):
        raise ConfigError(
            f"allowed_hosts={hosts!r} must be a list of host names, e.g. [models.lan] ([*]: any)"
        )
    if not isinstance(cfg.prefix_cache, bool):
        raise ConfigError(f"prefix_cache={cfg.prefix_cache!r} must be true or false")
    if cfg.max_step_tokens is not None and cfg.max_step_tokens < cfg.max_batch:
        raise ConfigError(
            f"max_step_tokens={cfg.max_step_tokens} must be at least max_batch={cfg.max_batch} (a step feeds "
            "every running sequence's token)"
        )
    if cfg.port > 65535:
        raise ConfigError(f"port={cfg.port} must be at most 65535")
    api_key = cfg.api_key if cfg.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not str(api_key).strip():
        raise ConfigError("api_key is empty; give a key, or null for none")
    # the run first, torch after (the server's modules, the device, the model): a run= that is not one is
    # one line in 0.24 s of CPU, not 3.3 s (issue 47 item 12, docs/benchmarks.md)
    find_run_checkpoint(cfg.run)
    from gptkit.inference.block_pool import Paging
    from gptkit.serve.served import load_served
    from gptkit.serve.server import bind, serve

    set_threads(cfg.threads, "threads", warn=resolve_device(cfg.device) == "cpu")
    # a port in use fails now, not after the model has loaded
    sock = bind(str(cfg.host), int(cfg.port))
    served = load_served(
        cfg.run,
        name=cfg.model_name,
        template=str(cfg.template),
        device=cfg.device,
        dtype=cfg.dtype,
        attention=cfg.attention,
        max_batch=cfg.max_batch,
        max_queue=cfg.max_queue,
        allow_special_text=cfg.special_tokens_in_content == "allow",
        quantize=cfg.quantize,
        draft=cfg.draft,
        draft_k=cfg.draft_k,
        paging=Paging(cfg.block_size, cfg.kv_blocks, cfg.max_step_tokens, cfg.prefix_cache),
    )
    return serve(
        served,
        host=str(cfg.host),
        sock=sock,
        api_key=None if api_key is None else str(api_key),
        max_request_bytes=int(cfg.max_request_bytes),
        access_log=bool(cfg.access_log),
        allowed_hosts=tuple(str(h).strip() for h in hosts),
        request_timeout=float(timeout),
        limit_concurrency=int(cfg.limit_concurrency),
    )
