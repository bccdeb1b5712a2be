"""Analytic: never allocates weights, so `model=llama3-70b` answers as fast as a tiny model.

Examples:
  gptkit count-params model=llama2-7b
  gptkit count-params model=gpt2 tokens=300B gpu=h100 mfu=0.45      (tokens: 300e9, 300B, 2T, 1.5e12 ...)
  gptkit count-params model=llama3-8b precision=bf16-mixed n_gpus=8 format=json
"""

from __future__ import annotations

import json

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def report(cfg) -> dict:
    """Everything count-params knows, as plain data (the json output)."""
    from gptkit import accounting as acc
    from gptkit.adapters import adapter_params
    from gptkit.conf_tree import count, model_config, number
    from gptkit.errors import ConfigError
    from gptkit.precision import DTYPE_BYTES, precision

    m = model_config(cfg.model)
    pc = acc.count_params(m)
    seq_len = None if cfg.seq_len is None else number(cfg.seq_len, "seq_len", int, 1)
    fl = acc.flops_per_token(m, seq_len)
    for key in ("dtype", "kv_dtype"):
        if cfg[key] not in DTYPE_BYTES:
            raise ConfigError(f"{key}={cfg[key]!r} is not one of {', '.join(DTYPE_BYTES)}")
    precision(cfg.precision, "precision")
    if not 0 < float(cfg.mfu) <= 1:
        raise ConfigError(f"mfu={cfg.mfu} must be in (0, 1]")
    if cfg.peak_tflops is not None:
        peak = number(cfg.peak_tflops, "peak_tflops") * 1e12
    else:
        gpu = str(cfg.gpu).lower()
        if gpu not in acc.ACCELERATORS:
            raise ConfigError(
                f"unknown gpu={cfg.gpu!r}; known: {', '.join(acc.ACCELERATORS)} (or set peak_tflops=)"
            )
        if cfg.dtype not in acc.ACCELERATORS[gpu]:
            raise ConfigError(
                f"gpu={gpu} has no {cfg.dtype} peak in the table; pick dtype= one of "
                f"{', '.join(acc.ACCELERATORS[gpu])} or set peak_tflops="
            )
        peak = acc.peak_flops(gpu, cfg.dtype)
    tokens = count(cfg.tokens, "tokens") if cfg.tokens is not None else 20.0 * pc.total
    n_gpus = int(cfg.n_gpus)
    if n_gpus < 1:
        raise ConfigError(f"n_gpus={cfg.n_gpus} must be >= 1")
    # N: the active parameters (all of them for a dense model)
    train_6nd = 6.0 * pc.active * tokens
    # the MFU convention (perf/mfu): full attention
    train_full = fl.train_dense * tokens
    # perf/mfu_causal
    train_causal = fl.train_causal * tokens
    hours = lambda flops: flops / (peak * float(cfg.mfu)) / 3600.0  # noqa: E731
    kv_tok = acc.kv_cache_bytes_per_token(m, cfg.kv_dtype)
    ep = cfg.get("expert_parallel")
    if ep is not None and (
        isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or n_gpus % ep or m.moe is None
    ):
        raise ConfigError(
            f"expert_parallel={ep} must be a divisor of n_gpus={n_gpus} and the model a mixture of experts "
            f"(null: the experts sharded with the rest)"
        )
    if ep is not None and m.moe.n_experts % ep:
        raise ConfigError(f"expert_parallel={ep} must divide model.moe.n_experts={m.moe.n_experts}")
    lora, rows_per_item, frozen, chunked = _training(cfg, m)
    from gptkit.parallel_plan import check_mesh, communication, memory_per_gpu, recomputed_layers
    from gptkit.training.config_checks import checkpointing_mode

    # the mesh: n_gpus = dp x cp x tp (one line naming the dimension that does not divide)
    mesh = check_mesh(m, n_gpus, cfg.get("tensor_parallel", 1), cfg.get("context_parallel", 1), ep, seq_len)
    checks = {
        "activation_checkpointing": cfg.checkpointing,
        "activation_checkpointing_policy": cfg.get("checkpointing_policy", "ops"),
        "activation_checkpointing_every": cfg.get("checkpointing_every", 2),
    }
    try:
        checkpointing = checkpointing_mode(checks)
    except ConfigError as e:
        raise ConfigError(str(e).replace("trainer.activation_checkpointing", "checkpointing")) from None
    rows = int(cfg.micro_batch) * rows_per_item
    mem = memory_per_gpu(
        m,
        mesh,
        cfg.precision,
        rows,
        seq_len,
        checkpointing=checkpointing,
        checkpointing_policy=checks["activation_checkpointing_policy"],
        checkpointing_every=checks["activation_checkpointing_every"],
        optimizer=str(cfg.optimizer),
        lora=lora,
        frozen=frozen,
    )
    recomputed = recomputed_layers(
        m, checkpointing, checks["activation_checkpointing_policy"], checks["activation_checkpointing_every"]
    )
    comm = communication(m, mesh, cfg.precision, rows, seq_len, recomputed=recomputed)
    if chunked:
        # DPO, KTO, GRPO: per-token log-probs chunk by chunk, as train's estimate counts them
        from gptkit.training.memory import chunked_logits_bytes

        mem["total"] -= mem["logits"]
        mem["logits"] = chunked_logits_bytes(rows * fl.seq_len, m) / (mesh.tp * mesh.cp)
        mem["total"] += mem["logits"]
    quantized = None
    if cfg.get("quantize") is not None:
        from gptkit.quant import QUANTIZE

        if cfg.quantize not in QUANTIZE:
            raise ConfigError(f"quantize={cfg.quantize} is not one of {', '.join(QUANTIZE)} (or null)")
        if cfg.quantize == "w8a8":
            raise ConfigError(
                "count-params counts quantize=int8, int4 or nf4; w8a8 holds int8's weights (count them with "
                "quantize=int8) and fbgemm's packed copy of the same values"
            )
        # the weights' dtype: the compute dtype's where it is one a model is cast to
        width = cfg.dtype if cfg.dtype in ("fp32", "bf16", "fp16") else "bf16"
        quantized = dict(acc.quantized_weights(m, str(cfg.quantize), width), kind=cfg.quantize, dtype=width)
    trainable = pc.total if lora is None else adapter_params(m, lora["targets"], lora["rank"])
    return {
        "model": m.to_dict(),
        "params": {
            "tok_emb": pc.tok_emb,
            "pos_emb": pc.pos_emb,
            "attn_q": pc.attn_q,
            "attn_k": pc.attn_k,
            "attn_v": pc.attn_v,
            "attn_o": pc.attn_o,
            "attn_sinks": pc.attn_sinks,
            "attn_gate": pc.attn_gate,
            # Gated DeltaNet's in_proj_ba, A_log, dt_bias and conv1d (its z projection is in attn_gate)
            "attn_linear": pc.attn_linear,
            "mlp": pc.mlp,
            "norms": pc.norms,
            "final_norm": pc.final_norm,
            "lm_head": pc.lm_head,
            "per_layer": pc.per_layer,
            "total": pc.total,
            "non_embedding": pc.non_embedding,
            # a mixture of experts (0 for a dense model; in mlp already)
            "router": pc.router,
            "experts": pc.experts,
            "shared_experts": pc.shared,
            # the multi-token prediction modules (model.mtp; in total, not in active)
            "mtp": pc.mtp,
            # what one token goes through (= total for a dense model)
            "active": pc.active,
        },
        "flops_per_token": {
            "seq_len": fl.seq_len,
            "n_matmul": fl.n_matmul,
            "forward_dense": fl.forward_dense,
            "forward_causal": fl.forward_causal,
            "train_dense": fl.train_dense,
            "train_causal": fl.train_causal,
            "attention_forward_dense": fl.attention_forward_dense,
            "attention_forward_causal": fl.attention_forward_causal,
            # layers with a sliding window (their attention counts min(W, T) keys)
            "local_layers": len(m.local_layers),
            "six_n": 6.0 * pc.active,
            "mfu_convention": "train_dense (perf/mfu, logged FLOP/s: 6N + 12·L·T·d_attn, full attention, as "
            "PaLM, nanoGPT and torchtitan); train_causal: perf/mfu_causal",
        },
        "plan": {
            "tokens": tokens,
            "tokens_is_compute_optimal": cfg.tokens is None,
            "compute_optimal_tokens": 20.0 * pc.total,
            "train_flops_6nd": train_6nd,
            "train_flops_full_attention": train_full,
            "train_flops_causal": train_causal,
            "peak_flops_per_gpu": peak,
            "mfu": float(cfg.mfu),
            "gpu_hours_6nd": hours(train_6nd),
            "gpu_hours_full_attention": hours(train_full),
            "gpu_hours_causal": hours(train_causal),
            "kv_cache_bytes_per_token": kv_tok,
            # local layers hold their window; linear layers (Gated DeltaNet) their fixed-size state
            "kv_cache_bytes_full_context": acc.kv_cache_bytes(m, fl.seq_len, cfg.kv_dtype),
            # of it, the linear layers' states (0 without one): they do not grow with the context
            "state_bytes": acc.kv_cache_bytes(m, 0, cfg.kv_dtype),
            "memory_per_gpu": mem,
            # bytes one GPU sends per micro-step, by kind (gptkit/parallel_plan.py, docs/parallelism.md)
            "communication_per_step": comm,
            "mesh": {"n_gpus": n_gpus, "dp": mesh.dp, "tp": mesh.tp, "cp": mesh.cp, "ep": mesh.ep or 1},
            "checkpointing": checkpointing or "none",
            "precision": cfg.precision,
            "n_gpus": n_gpus,
            "optimizer": str(cfg.optimizer),
            "muon_params": acc.muon_params(m) if lora is None else trainable,
            "finetune": str(cfg.finetune),
            "trainable_params": trainable,
            "objective": str(cfg.objective),
        },
        # quantize=: the weights with the block projections quantized (null without quantize=)
        "quantized_weights": quantized,
    }


def _training(cfg, m) -> tuple[dict | None, int, tuple[str, ...], bool]:
    """(the LoRA settings or None, sequences per micro-batch item, the frozen models of the starting weights
    it keeps (reference, teacher), whether the loss reads chunked log-probs instead of whole logits) of
    count-params' finetune=, lora and objective= (one-line errors as `train`'s)."""
    from gptkit.adapters import check_lora, settings
    from gptkit.errors import ConfigError

    if cfg.finetune not in ("full", "lora"):
        raise ConfigError(f"finetune={cfg.finetune!r} must be full or lora")
    lora = None
    if cfg.finetune == "lora":
        lora = settings({"alpha": 1, "dropout": 0.0, **cfg.lora})
        lora["targets"] = list(check_lora(lora, m))
    if cfg.objective == "lm":
        return lora, 1, (), False
    # the objectives table imports torch: only for an objective other than lm
    from gptkit.training.objectives import objective_class

    objective = objective_class(cfg)
    # its config group: train's defaults (conf/train.yaml) under count-params' keys (dpo.loss: simpo and orpo
    # hold no reference; grpo.group_size, grpo.beta > 0: a reference), checked as `train` checks it; the
    # frozen models it holds are the ones it names, as train's estimate asks them (a teacher counted at the
    # model's size, as frozen.teacher=start)
    group = _train_group(cfg, objective.group)
    objective.check_config(group)
    return lora, objective.rows(group), tuple(objective.frozen_models(group)), objective.chunked_logps


def _train_group(cfg, name):
    """conf/train.yaml's group `name` with count-params' own keys of it merged over (None: no group)."""
    if not name:
        return None
    from omegaconf import OmegaConf

    from gptkit.conf_files import conf_dir

    train = OmegaConf.load(conf_dir() / "train.yaml").get(name)
    mine = cfg.get(name)
    if train is None or mine is None:
        return mine if train is None else train
    return OmegaConf.merge(train, mine)


def run(cfg) -> int:
    r = report(cfg)
    if cfg.format == "json":
        print(json.dumps(r, indent=2))
        return 0
    if cfg.format != "table":
        from gptkit.errors import ConfigError

        raise ConfigError(f"format={cfg.format!r} must be table or json")
    _print_tables(r, cfg)
    return 0


def _si(x: float, unit: str = "") -> str:
    for scale, s in (
        (1e24, "Y"),
        (1e21, "Z"),
        (1e18, "E"),
        (1e15, "P"),
        (1e12, "T"),
        (1e9, "G"),
        (1e6, "M"),
        (1e3, "k"),
    ):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {s}{unit}"
    return f"{x:.3g} {unit}".strip()


def _print_tables(r: dict, cfg) -> None:
    from rich.console import Console
    from rich.table import Table

    from gptkit.fsio import human_bytes

    con = Console()
    m, p, f, plan = r["model"], r["params"], r["flops_per_token"], r["plan"]
    L = m["n_layers"]
    total = p["total"]
    moe = m.get("moe")
    mlp = (
        f"{moe['n_experts']} experts top-{moe['top_k']}"
        + (f" + {moe['n_shared']} shared" if moe["n_shared"] else "")
        if moe
        else m["mlp"]
    )
    # multi-head latent attention caches no heads: one latent and one rotated key per token
    mla = m.get("mla") if m.get("attention_kind") == "mla" else None
    heads = (
        f"{m['n_heads']} heads; MLA caches a {mla['kv_lora_rank']}-wide latent and a "
        f"{mla['qk_rope_head_dim']}-wide rotated key per token"
        if mla
        else f"{m['n_heads']} heads / {m['n_kv_heads']} kv heads"
    )
    t = Table(
        title=f"{m['name']}: parameters ({m['position']} positions, {mlp}, {m['norm']}, {heads}, "
        f"{'tied' if m['tie_embeddings'] else 'untied'} embeddings)"
    )
    t.add_column("component")
    t.add_column("parameters", justify="right")
    t.add_column("share", justify="right")
    rows = [
        ("token embedding", p["tok_emb"]),
        ("position embedding", p["pos_emb"]),
        (f"attention q ({L} layers)", p["attn_q"]),
        (f"attention k ({L} layers)", p["attn_k"]),
        (f"attention v ({L} layers)", p["attn_v"]),
        (f"attention out ({L} layers)", p["attn_o"]),
        *([(f"attention sinks ({L} layers)", p["attn_sinks"])] if p["attn_sinks"] else []),
        *([(f"attention output gates ({L} layers)", p["attn_gate"])] if p["attn_gate"] else []),
        *(
            [("linear attention: beta and decay projections, A_log, dt_bias, conv1d", p["attn_linear"])]
            if p["attn_linear"]
            else []
        ),
        (f"mlp ({L} layers)" + (": routers, experts and dense MLPs" if moe else ""), p["mlp"]),
        (f"norms ({L} layers)", p["norms"]),
        ("final norm", p["final_norm"]),
        (
            "lm head" + (" (tied: counted in the token embedding)" if m["tie_embeddings"] else ""),
            p["lm_head"],
        ),
    ]
    if moe:
        n_moe = p["router"] // (moe["n_experts"] * m["d_model"])
        # after the mlp row (the optional attention rows before it move it)
        at = next(i for i, (name, _) in enumerate(rows) if name.startswith("mlp")) + 1
        rows[at:at] = [
            (f"  routers ({n_moe} MoE layers)", p["router"]),
            (f"  routed experts ({moe['n_experts']} per MoE layer, {moe['d_expert']} wide)", p["experts"]),
            ("  shared experts", p["shared_experts"]),
        ]
    if p["mtp"]:
        depth = m["mtp"]["depth"]
        rows.append((f"multi-token prediction (depth {depth}; training only, not active)", p["mtp"]))
    for name, n in rows:
        t.add_row(name, f"{n:,}", f"{100 * n / total:.2f}%")
    t.add_section()
    t.add_row("per layer" + (" (the first)" if moe else ""), f"{p['per_layer']:,}", "")
    t.add_row("non-embedding", f"{p['non_embedding']:,}", f"{100 * p['non_embedding'] / total:.2f}%")
    t.add_row("[bold]total", f"[bold]{total:,}", "100.00%")
    if moe or p["mtp"]:
        t.add_row(
            "[bold]active per token[/bold] ("
            + (f"top-{moe['top_k']} of the routed experts" if moe else "")
            + (", " if moe and p["mtp"] else "")
            + ("without the MTP modules" if p["mtp"] else "")
            + ")",
            f"[bold]{p['active']:,}",
            f"{100 * p['active'] / total:.2f}%",
        )
    con.print(t)

    ft = Table(title=f"FLOPs per token at context {f['seq_len']} (multiply-add = 2 FLOPs; matmuls only)")
    ft.add_column("")
    ft.add_column("full attention (perf/mfu)", justify="right")
    ft.add_column("causal (perf/mfu_causal)", justify="right")
    ft.add_row(
        "forward (2N + 4·L·T·d_attn)", _si(f["forward_dense"], "FLOP"), _si(f["forward_causal"], "FLOP")
    )
    ft.add_row("training (6N + 12·L·T·d_attn)", _si(f["train_dense"], "FLOP"), _si(f["train_causal"], "FLOP"))
    ft.add_row(
        "  of which attention scores",
        _si(3 * f["attention_forward_dense"], "FLOP"),
        _si(3 * f["attention_forward_causal"], "FLOP"),
    )
    n_is = "the active parameters" if moe else "all parameters"
    ft.add_row(f"6N with N = {n_is} (literature's C=6ND)", _si(f["six_n"], "FLOP"), "")
    con.print(ft)
    routed = (
        f" (an MoE layer's: its router, top-{moe['top_k']} routed and {moe['n_shared']} shared experts)"
        if moe
        else ""
    )
    con.print(
        f"N = {f['n_matmul']:,} matmul weights: every layer's q/k/v/o and MLP matrices{routed} plus the LM "
        f"head (a matmul even when tied). Embedding lookups, norms and biases do no matmul FLOPs.\n"
        f"MFU convention: perf/mfu, the logged FLOP/s and the GPU-hours below count full attention "
        f"(6N + 12·L·T·d_attn per token), as PaLM, nanoGPT and torchtitan do (published MFU figures); "
        f"perf/mfu_causal halves the attention term."
    )
    if f["local_layers"]:
        w = r["model"]["sliding_window"]
        con.print(
            f"Sliding window: {f['local_layers']} of the {r['model']['n_layers']} layers are local; each "
            f"counts w = min(W, T) = {min(w, f['seq_len'])} keys per query for T (full attention), "
            f"w - w^2/2T (causal), and caches at most W = {w} tokens."
        )

    et = Table(title="planned run")
    et.add_column("")
    et.add_column("value", justify="right")
    d = plan["tokens"]
    optimal = " (compute-optimal: 20 per parameter)" if plan["tokens_is_compute_optimal"] else ""
    et.add_row(f"training tokens D{optimal}", _si(d))
    et.add_row("compute-optimal tokens (~20 x params)", _si(plan["compute_optimal_tokens"]))
    et.add_row("training FLOPs, 6·N·D", f"{plan['train_flops_6nd']:.3e}")
    et.add_row(
        "training FLOPs, per-token x D (full attention: the MFU convention)",
        f"{plan['train_flops_full_attention']:.3e}",
    )
    et.add_row("training FLOPs, per-token x D (causal)", f"{plan['train_flops_causal']:.3e}")
    gpu = "custom peak" if cfg.peak_tflops is not None else f"{cfg.gpu} {cfg.dtype}"
    et.add_row(
        f"GPU-hours at {plan['peak_flops_per_gpu'] / 1e12:g} TFLOP/s ({gpu}), MFU {plan['mfu']:.0%}",
        f"{plan['gpu_hours_6nd']:,.0f} (6ND) / {plan['gpu_hours_full_attention']:,.0f} (full attention)",
    )
    et.add_row(f"KV cache per token ({cfg.kv_dtype})", human_bytes(plan["kv_cache_bytes_per_token"]))
    et.add_row(
        f"KV cache at full context ({f['seq_len']} tokens, batch 1)"
        + (", the linear layers' states included" if plan["state_bytes"] else ""),
        human_bytes(plan["kv_cache_bytes_full_context"]),
    )
    if plan["state_bytes"]:
        et.add_row("  of which the linear layers' states (any context)", human_bytes(plan["state_bytes"]))
    mem = plan["memory_per_gpu"]
    shard = f", sharded over {plan['n_gpus']} GPUs" if plan["n_gpus"] > 1 else ""
    et.add_section()
    lora = plan["finetune"] == "lora"
    share = 100 * plan["trainable_params"] / total
    trained = (
        f"LoRA adapters: {plan['trainable_params']:,} trainable, {share:.2f}%"
        if lora
        else "every parameter trains"
    )
    others = plan["trainable_params"] - plan["muon_params"]
    state = (
        f"Muon: one momentum buffer for {plan['muon_params']:,} block-matrix parameters"
        + (f", AdamW's two moments for the other {others:,}" if others else "")
        if plan["optimizer"] == "muon"
        else "AdamW: two moments per trainable parameter"
    )
    what = {
        "weights": f"weights ({plan['precision']}{shard}"
        + (", the frozen base and the adapters)" if lora else ")"),
        "gradients": f"gradients ({trained})",
        "optimizer": f"optimizer state ({state})",
    }
    for k in ("weights", "gradients", "optimizer"):
        et.add_row(f"training memory per GPU: {what[k]}", human_bytes(mem[k]))
    if "reference" in mem:
        reference = f"the {plan['objective'].upper()} reference (a frozen copy of the weights)"
        et.add_row(f"training memory per GPU: {reference}", human_bytes(mem["reference"]))
    mesh = plan["mesh"]
    split = " / ".join(f"{k} {mesh[k]}" for k in ("tp", "cp") if mesh[k] > 1)
    et.add_row(
        f"training memory per GPU: activations (estimate, micro-batch {cfg.micro_batch}, checkpointing "
        f"{plan['checkpointing']}{', split over ' + split if split else ''})",
        human_bytes(mem["activations"]),
    )
    et.add_row("training memory per GPU: logits and loss", human_bytes(mem["logits"]))
    if "ring_kv" in mem:
        et.add_row(
            "training memory per GPU: the ring's K,V chunks in flight (cp)", human_bytes(mem["ring_kv"])
        )
    et.add_row("[bold]training memory per GPU: total", f"[bold]{human_bytes(mem['total'])}")
    con.print(et)
    comm = plan["communication_per_step"]
    if len(comm) > 1:
        ct = Table(
            title=f"mesh: {mesh['n_gpus']} GPUs = dp {mesh['dp']} x cp {mesh['cp']} x tp {mesh['tp']}"
            + (f", ep {mesh['ep']}" if mesh["ep"] > 1 else "")
            + ": bytes one GPU sends per micro-step (forward + backward; docs/parallelism.md)"
        )
        ct.add_column("kind")
        ct.add_column("bytes", justify="right")
        names = {
            "tp": "tp: 4 all-gathers/reduce-scatters of \\[b, T/cp, d] per layer forward, 4 backward, 3 more "
            "recomputed; embedding, head, loss and replicated weights' gradients",
            "cp": "cp: each rank's K,V chunk passed on cp-1 times per layer forward (and recomputed); K,V "
            "cp-1 times and dK,dV (fp32) cp times backward",
            "fsdp_all_gather": "fsdp: the weights all-gathered forward and backward",
            "fsdp_reduce_scatter": "fsdp: the gradients reduce-scattered (fp32)",
            "dp_all_reduce": "dp: the gradients all-reduced (fp32)",
            "ep": "ep: dispatch and combine all-to-alls per MoE layer, forward and backward",
            "ep_gradients": "ep: each expert group's gradients all-reduced over its replicas",
        }
        for k, v in comm.items():
            if k != "total":
                ct.add_row(names[k], human_bytes(v))
        ct.add_row("[bold]total", f"[bold]{human_bytes(comm['total'])}")
        con.print(ct)
    q = r.get("quantized_weights")
    if q:
        qt = Table(
            title=f"weights with quantize={q['kind']} (every block's linear projections"
            + (", the LM head (as on the CPU)" if q["kind"] == "int8" else "")
            + f"; the rest {q['dtype']})"
        )
        qt.add_column("")
        qt.add_column("bytes", justify="right")
        qt.add_row(f"quantized, {q['bits']:.3g} bits per value", human_bytes(q["quantized"]))
        head = "" if q["kind"] == "int8" else ", LM head"
        qt.add_row(f"embeddings, norms{head}, biases ({q['dtype']})", human_bytes(q["rest"]))
        qt.add_row("[bold]total", f"[bold]{human_bytes(q['total'])}")
        qt.add_row(
            f"the same weights all in {q['dtype']}",
            f"{human_bytes(q['full'])} ({q['total'] / q['full']:.3f}x)",
        )
        con.print(qt)
