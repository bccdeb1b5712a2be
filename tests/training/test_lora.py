"""finetune=lora: adapters on a frozen model (gptkit.training.finetune.lora, gptkit.adapters), trained,
checkpointed (adapters only), resumed exactly, merged for sample/eval/export, exported for PEFT; bad input
in one line."""

import csv
from pathlib import Path

import pytest
import torch
from conftest import (
    HANG_S,
    HYBRID_MODEL,
    TWO_CPU_RANKS,
    estimate_plan,
    exports,
    finetune_args,
    finetune_base,
    make_run,
    resume_on_one_process,
    run_main,
)
from conftest import run_group as process_group

from gptkit.adapters import CHECKPOINT_KEY, check_lora, is_adapter_key
from gptkit.errors import ConfigError
from gptkit.model import GPT, ModelConfig
from gptkit.training.finetune.lora import adapters_disabled, apply_lora, is_lora, merged_state_dict

LLAMA = dict(mlp="swiglu", norm="rmsnorm", bias=False, n_kv_heads=2, position="rope")
# a mixture of experts: layer 0 dense, layer 1 4 experts (top-2), whose gate/up/down adapters are per expert
MOE = dict(LLAMA, moe=dict(n_experts=4, top_k=2, d_expert=24, every=2))
ALL = ["q", "k", "v", "o", "gate", "up", "down"]
# multi-head latent attention: its own projections are the attention targets (q or q_a/q_b, kv_a, kv_b, o)
MLA = dict(
    LLAMA,
    n_kv_heads=4,
    attention_kind="mla",
    mla=dict(q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
)
# issue 49's blocks: sinks, the output gate, a window layer, a NoPE layer, partial RoPE, and gpt-oss's experts
# (the sinks and the output gate's attn.gate_proj are base weights: frozen, never a target; lora's gate is the
# MLP's)
NEW = dict(LLAMA, attn_sinks=True, attn_output_gate=True, sliding_window=8, layer_types=["local", "global"])
NEW.update(nope_layers=[1], rotary_dim=4)
GPT_OSS = dict(NEW, moe=dict(MOE["moe"], router_bias=True, expert_biases=True, activation="clamped_swiglu"))
MLA_Q = dict(MLA, mla=dict(MLA["mla"], q_lora_rank=12))
# a hybrid of a Gated DeltaNet layer and a softmax one: q, k, v, o adapt both layers' attention (the linear
# layer's in_proj_qkvz by parts, out_proj), z and ba the linear layer's only; 2 value heads per key head
GDN = dict(LLAMA, layer_types=["linear", "global"])
GDN.update(gdn=dict(n_key_heads=2, n_value_heads=4, key_head_dim=8, value_head_dim=8))
GDN_ALL = ["q", "k", "v", "o", "z", "ba", "gate", "up", "down"]
# Qwen3.5's layout of the same layer (model.gdn.layout=split): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
GDN_SPLIT = dict(GDN, gdn=dict(GDN["gdn"], layout="split"))
MLA_ALL = ["q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down"]


def tiny(style: dict, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(
        ModelConfig(vocab_size=40, max_seq_len=16, n_layers=2, n_heads=4, d_model=32, init_std=0.3, **style)
    ).eval()


def settings(**kw):
    return {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ALL, **kw}


@pytest.mark.parametrize(
    "style, targets",
    [
        (LLAMA, ALL),
        ({}, ["q", "k", "v", "o", "up", "down"]),
        (MOE, ALL),
        (MOE, ["q", "up"]),
        (NEW, ALL),
        (GPT_OSS, ALL),
        (MLA, ["q", "kv_a", "kv_b", "o", "gate", "up", "down"]),
        (MLA_Q, MLA_ALL),
        (GDN, GDN_ALL),
        (GDN, ["k", "z", "up"]),
        (GDN_SPLIT, ["q", "k", "v", "o", "z", "gate", "up", "down"]),
    ],
    ids=[
        "llama",
        "gpt2",
        "moe",
        "moe-q-up",
        "new-blocks",
        "gpt-oss",
        "mla",
        "mla-q-lora",
        "gdn-hybrid",
        "gdn-k-z-up",
        "gdn-split",
    ],
)
def test_adapters_start_at_the_base_and_switch_off_and_merge_exactly(style, targets):
    model = tiny(style)
    x = torch.randint(0, 40, (2, 12))
    base = model(x).logits
    n_before = sum(p.numel() for p in model.parameters())
    trainable = apply_lora(model, settings(targets=targets))
    assert is_lora(model) and not is_lora(tiny(style))
    named = dict(model.named_parameters())
    assert trainable == sum(p.numel() for p in named.values() if p.requires_grad) > 0
    # only the adapters train (not the sinks, the output gate, the router's or the experts' biases)
    assert all(is_adapter_key(k) == p.requires_grad for k, p in named.items())
    if style.get("attn_sinks"):
        assert "blocks.1.attn.sinks" in named and "blocks.1.attn.gate_proj.weight" in named
        assert not any(k.startswith("blocks.1.attn.gate_proj.lora") for k in named)
        assert "blocks.0.mlp.lora_gate_A" in {k.replace("gate_proj.", "") for k in named}
    assert sum(p.numel() for p in named.values()) == n_before + trainable
    # B = 0: the base model at the start
    assert torch.equal(model(x).logits, base)
    with torch.no_grad():
        for p in named.values():
            if p.requires_grad:
                p.normal_(0, 0.2)
    adapted = model(x).logits
    assert not torch.allclose(adapted, base)
    with adapters_disabled(model):
        # exactly the base (DPO's reference), no second copy
        assert torch.equal(model(x).logits, base)
    # back on after the block
    assert torch.equal(model(x).logits, adapted)
    merged = merged_state_dict(model)
    plain = tiny(style).state_dict()
    assert {k: v.shape for k, v in merged.items()} == {k: v.shape for k, v in plain.items()}
    torch.testing.assert_close(GPT.from_state(model.cfg, merged)(x).logits, adapted, atol=2e-5, rtol=0)


def test_mla_adapters_decode_through_the_latent_cache_as_recomputed():
    """The absorbed decoding path reads kv_b_proj's weight as W_uk and W_uv: with adapters on every projection
    (kv_b's included) the cached decode's logits are the full forward's, adapters on and off."""
    from gptkit.model.kv_cache import KVCache

    model = tiny(MLA_Q)
    apply_lora(model, settings(targets=MLA_ALL))
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters() if p.requires_grad}
    assert shapes["blocks.0.attn.kv_b_proj.lora_kv_b_B"] == (4 * 16, 4)
    assert shapes["blocks.1.attn.q_a_proj.lora_q_a_A"] == (4, 32)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2)
    x = torch.randint(0, 40, (2, 12))

    def decoded():
        cache = KVCache(model.cfg, batch_size=2)
        got = [model(x[:, :5], cache=cache).logits]
        got += [model(x[:, t : t + 1], cache=cache).logits for t in range(5, 12)]
        return torch.cat(got, dim=1)

    with torch.no_grad():
        full = model(x).logits
        torch.testing.assert_close(decoded(), full, atol=1e-5, rtol=0)
        with adapters_disabled(model):
            base = model(x).logits
            torch.testing.assert_close(decoded(), base, atol=1e-5, rtol=0)
    assert (full - base).abs().max() > 1e-2


def test_linear_attention_adapters_slice_in_proj_qkvz_per_key_head_decode_and_train_alone():
    """A hybrid's linear layer: q, k, v and z adapt their rows of in_proj_qkvz, which interleaves them per key
    head; merged, each adds scale * B @ A exactly on its own rows (B's rows head by head) and nowhere else.
    The adapted model decodes through its recurrent state as it computes whole, and only the adapters get
    gradients."""
    from gptkit.model.kv_cache import KVCache

    model = tiny(GDN)
    apply_lora(model, settings(targets=GDN_ALL))
    named = dict(model.named_parameters())
    assert named["blocks.0.attn.in_proj_qkvz.lora_q_B"].shape == (2 * 8, 4)
    assert named["blocks.0.attn.in_proj_qkvz.lora_z_B"].shape == (4 * 8, 4)
    assert named["blocks.0.attn.in_proj_ba.lora_ba_B"].shape == (8, 4)
    assert named["blocks.0.attn.out_proj.lora_o_A"].shape == (4, 32)
    # the softmax layer has q, k, v, o (no z, ba)
    assert "blocks.1.attn.qkv_proj.lora_q_A" in named
    assert not any(k.startswith("blocks.1.") and ("lora_z" in k or "lora_ba" in k) for k in named)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    w = "blocks.0.attn.in_proj_qkvz.weight"
    sizes = {"q": 8, "k": 8, "v": 16, "z": 16}
    for j, t in enumerate(sizes):
        with torch.no_grad():
            for k, p in named.items():
                if p.requires_grad:
                    p.normal_(0, 0.2) if k.endswith(f"in_proj_qkvz.lora_{t}_B") else p.zero_()
            a, b = (
                named[f"blocks.0.attn.in_proj_qkvz.lora_{t}_A"],
                named[f"blocks.0.attn.in_proj_qkvz.lora_{t}_B"],
            )
            a.normal_(0, 0.2)
        delta = (merged_state_dict(model)[w] - base[w]).view(2, 48, 32).split(list(sizes.values()), dim=1)
        want = (2.0 * b @ a).view(2, sizes[t], 32)  # alpha / rank = 2; head by head
        for i, part in enumerate(delta):
            torch.testing.assert_close(part, want if i == j else torch.zeros_like(part), atol=1e-6, rtol=0)
    with torch.no_grad():
        for p in named.values():
            if p.requires_grad:
                p.normal_(0, 0.2)
    x = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        full = model(x).logits
        cache = KVCache(model.cfg, batch_size=2)
        got = [model(x[:, :5], cache=cache).logits]
        got += [model(x[:, t : t + 1], cache=cache).logits for t in range(5, 12)]
        torch.testing.assert_close(torch.cat(got, dim=1), full, atol=1e-4, rtol=0)
    model.train()
    model(x[:, :-1], x[:, 1:]).loss.backward()
    assert all((p.grad is not None) == is_adapter_key(k) for k, p in named.items())
    assert named["blocks.0.attn.in_proj_ba.lora_ba_A"].grad.abs().sum() > 0


def test_split_layout_adapters_take_whole_segments_of_in_proj_qkv_and_in_proj_z_and_decode():
    """Under model.gdn.layout=split (Qwen3.5's) q, k and v adapt one segment each of in_proj_qkv (all q rows,
    then all k, then all v) and z the whole in_proj_z: merged, each adds scale * B @ A on its own rows and
    nowhere else; the adapted model decodes through its recurrent state as it computes whole."""
    from gptkit.model.kv_cache import KVCache

    model = tiny(GDN_SPLIT)
    targets = ["q", "k", "v", "o", "z"]
    apply_lora(model, settings(targets=targets))
    named = dict(model.named_parameters())
    # 2 key heads of 8 (q, k: 16 rows each), 4 value heads of 8 (v: 32 rows; z: in_proj_z's 32)
    assert named["blocks.0.attn.in_proj_qkv.lora_k_B"].shape == (16, 4)
    assert named["blocks.0.attn.in_proj_z.lora_z_B"].shape == (32, 4)
    assert all(is_adapter_key(k) for k, p in named.items() if p.requires_grad)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    rows = {"q": (0, 16), "k": (16, 32), "v": (32, 64), "z": (0, 32)}
    for t, (start, end) in rows.items():
        module = "in_proj_z" if t == "z" else "in_proj_qkv"
        with torch.no_grad():
            for k, p in named.items():
                if p.requires_grad:
                    p.normal_(0, 0.2) if k.startswith(f"blocks.0.attn.{module}.lora_{t}_") else p.zero_()
        a, b = named[f"blocks.0.attn.{module}.lora_{t}_A"], named[f"blocks.0.attn.{module}.lora_{t}_B"]
        merged = merged_state_dict(model)
        for m in ("in_proj_qkv", "in_proj_z"):
            w = f"blocks.0.attn.{m}.weight"
            want = torch.zeros_like(base[w])
            if m == module:
                want[start:end] = 2.0 * b @ a  # alpha / rank = 2
            torch.testing.assert_close(merged[w] - base[w], want, atol=1e-6, rtol=0)
    with torch.no_grad():
        for p in named.values():
            if p.requires_grad:
                p.normal_(0, 0.2)
        x = torch.randint(0, 40, (2, 12))
        full = model(x).logits
        cache = KVCache(model.cfg, batch_size=2)
        got = [model(x[:, :5], cache=cache).logits]
        got += [model(x[:, t : t + 1], cache=cache).logits for t in range(5, 12)]
        torch.testing.assert_close(torch.cat(got, dim=1), full, atol=1e-4, rtol=0)


def test_a_mixtures_expert_adapters_are_per_expert_grouped_as_the_loop_and_train():
    model = tiny(MOE)
    apply_lora(model, settings())
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters() if p.requires_grad}
    # layer 0 dense: a matrix each; layer 1: one per expert, [E, rank, in] and [E, out, rank]
    assert shapes["blocks.0.mlp.gate_proj.lora_gate_A"] == (4, 32)
    assert shapes["blocks.1.mlp.experts.lora_gate_A"] == (4, 4, 32)
    assert shapes["blocks.1.mlp.experts.lora_down_B"] == (4, 32, 4)
    assert not any(k.startswith(("blocks.1.mlp.router", "blocks.1.mlp.shared")) for k in shapes)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2)
    d = model.cfg.to_dict()
    loop = GPT(ModelConfig.from_dict(d | {"moe": d["moe"] | {"impl": "loop"}}))
    apply_lora(loop, settings())
    loop.load_state_dict(model.state_dict())
    x = torch.randint(0, 40, (2, 12))
    for m in (model, loop):
        m.train()
        out = m(x, x)
        (out.loss + out.aux.loss).backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    assert grads["blocks.1.mlp.experts.lora_up_B"].abs().sum() > 0
    for k, p in loop.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[k], atol=1e-6, rtol=1e-5, msg=k)
    # a token goes through top_k = 2 of the 4 experts' adapters: FLOPs count those
    from gptkit.adapters import adapter_params

    total, active = adapter_params(model.cfg, ALL, 4), adapter_params(model.cfg, ALL, 4, active=True)
    experts = sum(p.numel() for k, p in model.named_parameters() if "experts.lora" in k)
    assert total == sum(p.numel() for p in grads.values()) and total - active == experts // 2


def test_a_mixtures_expert_adapters_have_no_peft_export():
    from gptkit import hf
    from gptkit.errors import GptkitError

    model = tiny(MOE)
    apply_lora(model, settings(targets=["q", "up"]))
    d = model.cfg.to_dict()
    cfg = ModelConfig.from_dict(d | {"qk_norm": "head", "moe": d["moe"] | {"every": 2}})
    with pytest.raises(GptkitError, match="adapt a mixture's experts, which have no PEFT adapter layout"):
        hf.peft_adapters(model.state_dict(), cfg, settings(targets=["q", "up"]))


def test_latent_attention_adapters_have_no_peft_export_yet():
    """A DeepSeek import trained with LoRA on its MLA projections: export adapters=true is one line (the PEFT
    layout is written for multi-head attention's q/k/v), the merged export is the way out."""
    from gptkit import hf
    from gptkit.errors import GptkitError

    # transformers' latent norms' eps: the model DeepseekV3ForCausalLM would export
    model = tiny(dict(MLA, mla=dict(MLA["mla"], latent_norm_eps=1e-6)))
    apply_lora(model, settings(targets=["q", "kv_b", "o"]))
    with pytest.raises(GptkitError, match="attention_kind=mla: its LoRA targets have no PEFT adapter layout"):
        hf.peft_adapters(model.state_dict(), model.cfg, settings(targets=["q", "kv_b", "o"]))


def test_linear_attention_adapters_have_no_peft_export():
    """PEFT adapts whole modules: a hybrid's in_proj_qkvz adapted by parts has no layout there, so export
    adapters=true is one line naming the merged export."""
    from gptkit import hf
    from gptkit.errors import GptkitError

    model = tiny(GDN)
    apply_lora(model, settings(targets=["q", "z", "up"]))
    with pytest.raises(GptkitError, match=r"lora.targets \['q', 'z'\] adapt the linear-attention layers'"):
        hf.peft_adapters(model.state_dict(), model.cfg, settings(targets=["q", "z", "up"]))


@pytest.mark.parametrize(
    "style, lora, needle",
    [
        ({}, settings(targets=["q", "gate"]), "gate matches no module of this model (a GPT-2-style model"),
        (LLAMA, settings(targets=["query", "x"]), "query, x match no module"),
        (LLAMA, settings(targets=[]), "lora.targets=[] must be a non-empty list"),
        (LLAMA, settings(rank=0), "lora.rank=0 must be a positive integer"),
        (LLAMA, settings(rank=17), "lora.rank=17 is larger than the k projection (16 x 32)"),
        (LLAMA, settings(alpha=0), "lora.alpha=0 must be a number > 0"),
        (LLAMA, settings(dropout=1.0), "lora.dropout=1.0 must be a number in [0, 1)"),
        (LLAMA, settings(dropout=-0.1), "lora.dropout=-0.1 must be a number in [0, 1)"),
        (
            LLAMA,
            settings(targets=["q", "ba"]),
            "ba matches no module of this model (z and ba are a linear-attention layer's",
        ),
        (GDN, settings(rank=9, targets=GDN_ALL), "lora.rank=9 is larger than the ba projection (8 x 32)"),
        (GDN_SPLIT, settings(targets=GDN_ALL), "ba matches no module of this model"),
        (
            MLA,
            settings(targets=["q", "v"]),
            "lora.targets: v matches no module of this model (multi-head latent attention, "
            "model.attention_kind=mla: its attention targets are its own projections, whose keys and values "
            "come from kv_a and kv_b); its targets are q, o, kv_a, kv_b, gate, up, down",
        ),
        (MLA, settings(targets=["q_a"]), "q_a matches no module of this model"),
    ],
)
def test_bad_lora_settings_are_one_config_error(style, lora, needle):
    with pytest.raises(ConfigError, match=None) as exc:
        check_lora(lora, tiny(style).cfg)
    assert needle in str(exc.value), str(exc.value)


# ---- training through the CLI (in process) --------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return finetune_base(tmp_path_factory, "base")


def lora_args(base, runs: Path, name: str, *extra: str) -> list[str]:
    return finetune_args(base, runs, name, *extra, lora_dropout=0.1)


def rows(run: Path) -> dict[int, dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        kept = ("train/loss", "val/loss", "train/lr", "train/grad_norm")
        return {int(r["step"]): {k: v for k, v in r.items() if k.startswith(kept)} for r in csv.DictReader(f)}


def ckpt(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def test_lora_trains_only_adapters_checkpoints_them_and_resumes_exactly(base, tmp_path, capsys):
    runs = tmp_path / "runs"
    code, _, err = run_main(capsys, *lora_args(base, runs, "straight"))
    assert code == 0, err
    assert "LoRA: rank 4, alpha 16" in err and "checkpoints hold the adapters only" in err
    straight = ckpt(runs / "straight")
    state = straight["state_dict"]
    assert state and all(k.startswith("model.") and is_adapter_key(k[6:]) for k in state)
    # A and B of 7 targets in 2 blocks
    assert len(state) == 2 * 7 * 2
    assert straight[CHECKPOINT_KEY]["base"] == str((base[0] / "checkpoints" / "last.ckpt").resolve())
    adam = straight["optimizer_states"][0]["state"]
    # optimizer state for the adapters only
    assert len(adam) == len(state)
    base_state = torch.load(base[0] / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    # B moved off zero: it trained
    assert state["model.blocks.0.attn.qkv_proj.lora_q_B"].abs().sum() > 0
    size = lambda d: sum(v.numel() for v in d.values())  # noqa: E731
    assert size(state) < size(base_state) / 2

    # 2 steps, then resume to 4: the same rows and the same adapters, bit for bit (dropout 0.1 included)
    code, _, err = run_main(capsys, *lora_args(base, runs, "halves", "trainer.stop_at_step=2"))
    assert code == 0, err
    code, _, err = run_main(
        capsys, "train", f"resume={runs / 'halves'}", "trainer.progress=false", "trainer.threads=1"
    )
    assert code == 0, err
    want = rows(runs / "straight")
    losses = {r["train/loss"] for r in want.values() if r.get("train/loss")}
    # 4 steps, and the loss moves
    assert len(losses) == 4
    assert rows(runs / "halves") == want
    halves = ckpt(runs / "halves")["state_dict"]
    assert halves.keys() == state.keys() and all(torch.equal(halves[k], state[k]) for k in state)

    # sample loads the base with the adapters merged
    code, out, err = run_main(
        capsys, "sample", f"run={runs / 'straight'}", "prompt=ROMEO:", "max_new_tokens=8", "temperature=0"
    )
    assert code == 0 and out.startswith("ROMEO:"), err


def lora_run_by_hand(base_run: Path, out: Path, targets: list[str], seed: int = 1) -> tuple[Path, GPT]:
    """A LoRA run folder as `train finetune=lora` leaves it (config.yaml, tokenizer, adapters-only last.ckpt)
    with large random adapters on `base_run`'s model; returns it and the unmerged model it holds."""
    import shutil

    import yaml

    from gptkit.adapters import fingerprint
    from gptkit.runs import load_model

    _, base_ckpt, cfg, _, model = load_model(base_run)
    lora = settings(targets=targets)
    apply_lora(model, lora)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    (out / "checkpoints").mkdir(parents=True)
    shutil.copy(base_run / "tokenizer.json", out / "tokenizer.json")
    config = dict(cfg, finetune="lora", lora=lora, init_from=str(base_ckpt))
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    state = {"model." + k: v for k, v in model.state_dict().items() if is_adapter_key(k)}
    record = dict(lora, base=str(Path(base_ckpt).resolve()), base_fingerprint=fingerprint(base_ckpt))
    torch.save(
        {"state_dict": state, "global_step": 1, CHECKPOINT_KEY: record}, out / "checkpoints" / "last.ckpt"
    )
    return out, model.eval()


@pytest.mark.parametrize(
    "position, targets",
    [("rope", ["k", "o", "gate", "down"]), ("learned", ["q", "v", "up"])],
    ids=["llama", "gpt2"],
)
def test_export_merges_and_writes_a_peft_adapter_that_peft_loads(tmp_path, capsys, position, targets):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_run, _, _ = make_run(tmp_path, position=position, max_seq_len=32)
    run, unmerged = lora_run_by_hand(base_run, tmp_path / "lora-run", targets)
    out = exports(
        capsys,
        [f"run={base_run}", f"out={tmp_path / 'hf-base'}"],
        [f"run={run}", f"out={tmp_path / 'hf-merged'}"],
        [f"run={run}", f"out={tmp_path / 'hf-adapter'}", "adapters=true"],
    )
    assert "exported the LoRA adapters" in out and "adapter_model.safetensors" in out
    # the adapters' own parameters (a Llama-style model's PEFT file holds exactly those)
    trained = sum(v.numel() for k, v in unmerged.state_dict().items() if is_adapter_key(k))
    assert f"; {trained:,} trainable parameters" in out
    assert ("stored as" in out) == (position == "learned")
    x = torch.randint(0, unmerged.cfg.vocab_size, (2, 20))
    with torch.no_grad():
        ours = unmerged(x).logits
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base").eval()
        plain = base(x).logits
        peft_model = PeftModel.from_pretrained(base, tmp_path / "hf-adapter").eval()
        theirs = peft_model(x).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-merged").eval()(x).logits
    # the adapters matter, so the comparisons below mean something
    assert (ours - plain).abs().max() > 0.1
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    torch.testing.assert_close(merged, ours, atol=1e-4, rtol=0)
    code, _, err = run_main(capsys, "export", f"run={base_run}", f"out={tmp_path / 'x'}", "adapters=true")
    assert code == 2 and "is not a LoRA run's checkpoint" in err and not (tmp_path / "x").exists()


def test_start_up_and_adapter_export_count_the_same_trainable_parameters(tmp_path, capsys):
    """A GPT-2-style base with adapters on q, k, v, o: PEFT's file holds zeros beside c_attn's q, k, v blocks,
    so it stores more values than training trains; both lines count the trainable parameters, and the
    export's says how many values it stores (issue 34: 65,536 at start-up, 114,688 at export)."""
    import re

    from safetensors.torch import load_file

    base_run, _, _ = make_run(tmp_path, position="learned", max_seq_len=32)
    args = lora_args((base_run, tmp_path / "corpus.txt"), tmp_path / "runs", "qkvo", "trainer.max_steps=1")
    args = [a if not a.startswith("lora.targets=") else "lora.targets=[q,k,v,o]" for a in args]
    code, _, err = run_main(capsys, *args)
    assert code == 0, err
    (trained,) = re.findall(r"on q, k, v, o: ([\d,]+) trainable parameters", err)
    adapter = tmp_path / "adapter"
    code, out, err = run_main(
        capsys, "export", f"run={tmp_path / 'runs' / 'qkvo'}", f"out={adapter}", "adapters=true"
    )
    assert code == 0, err
    stored = sum(v.numel() for v in load_file(adapter / "adapter_model.safetensors").values())
    state = ckpt(tmp_path / "runs" / "qkvo")["state_dict"]
    assert int(trained.replace(",", "")) == sum(v.numel() for v in state.values()) < stored
    assert (
        f"; {trained} trainable parameters, stored as {stored:,} values: PEFT's adapter on GPT-2's fused "
        in out
    )


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["~init_from"], "finetune=lora trains adapters on frozen weights, so it needs the weights to start"),
        (["lora.targets=[q,query]"], "lora.targets: query matches no module of this model"),
        (["lora.rank=0"], "lora.rank=0 must be a positive integer"),
        (["lora.rank=33"], "lora.rank=33 is larger than the q projection (32 x 32)"),
        (["lora.alpha=0"], "lora.alpha=0 must be a number > 0"),
        (["lora.dropout=1.0"], "lora.dropout=1.0 must be a number in [0, 1)"),
        (["finetune=dora"], "finetune=dora must be full"),
    ],
    ids=["no-init", "targets", "rank0", "rank-big", "alpha", "dropout", "finetune"],
)
def test_bad_lora_input_is_one_line_before_anything_is_written(base, tmp_path, capsys, extra, needle):
    drop = "init_from=" if extra == ["~init_from"] else None
    args = [a for a in lora_args(base, tmp_path / "runs", "bad") if drop is None or not a.startswith(drop)]
    code, _, err = run_main(capsys, *args, *[e for e in extra if e != "~init_from"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert needle in err, err
    assert not (tmp_path / "runs").exists()


def test_resume_keeps_finetune_and_the_adapters_shape(base, tmp_path, capsys):
    """resume= of a full run with finetune=lora (and the reverse, and other adapters) is one line; the run
    folder is untouched."""
    runs = tmp_path / "runs"
    code, _, err = run_main(capsys, *lora_args(base, runs, "lora", "trainer.max_steps=1"))
    assert code == 0, err
    code, _, err = run_main(capsys, *lora_args(base, runs, "full", "trainer.max_steps=1", "finetune=full"))
    assert code == 0, err
    before = {p: p.stat().st_mtime_ns for p in runs.rglob("*") if p.is_file() and p.name != ".lock"}
    for run, extra, needle in (
        ("lora", ["finetune=full"], "continues a finetune=lora run (its checkpoint holds the adapters"),
        ("lora", ["lora.rank=2"], "continues adapters with lora.rank=4; lora.rank=2 would not fit"),
        ("lora", ["lora.targets=[q]"], "lora.targets=[q, k, v, o, gate, up, down]; lora.targets=[q]"),
        ("full", ["finetune=lora"], "continues a finetune=full run (its checkpoint holds every weight)"),
    ):
        code, _, err = run_main(capsys, "train", f"resume={runs / run}", "trainer.max_steps=2", *extra)
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    after = {p: p.stat().st_mtime_ns for p in runs.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before


def run_group(*argv: str, timeout: float = HANG_S):
    """`python -m gptkit ...` in its own session (conftest's run_group); its stderr, once it succeeded."""
    r = process_group("-m", "gptkit", *argv, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


@pytest.mark.long
def test_lora_on_ddp_and_fsdp2_follows_one_process(base, tmp_path, capsys):
    """2 CPU processes (gloo), global batch 4 either way: DDP and FSDP2 (rank 1 starts on the meta device)
    train the adapters as one process does; FSDP2's sharded adapters-only checkpoint resumes in one
    process."""
    runs = tmp_path / "runs"
    common = ("lora.dropout=0.0", "trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.val_every=4")
    code, _, err = run_main(capsys, *lora_args(base, runs, "one", *common))
    assert code == 0, err
    want = {s: float(r["train/loss"]) for s, r in rows(runs / "one").items() if r.get("train/loss")}
    # the loss moves: equal trajectories are no coincidence
    assert len(set(want.values())) == 4
    two = TWO_CPU_RANKS
    run_group(*lora_args(base, runs, "ddp", *common, "trainer=ddp", *two))
    err = run_group(
        *lora_args(
            base,
            runs,
            "fsdp",
            *common,
            "trainer=fsdp",
            "trainer.precision=32-true",
            "trainer.stop_at_step=2",
            *two,
        ),
    )
    assert "start on the meta device" in err
    sharded = runs / "fsdp" / "checkpoints" / "step-000002.ckpt"
    assert (sharded / ".metadata").is_file()
    resume_on_one_process(capsys, runs / "fsdp")
    for name in ("ddp", "fsdp"):
        got = {s: float(r["train/loss"]) for s, r in rows(runs / name).items() if r.get("train/loss")}
        assert got.keys() == want.keys(), (name, got)
        for s in want:
            assert abs(got[s] - want[s]) < 1e-5, (name, s, got[s], want[s])


@pytest.fixture(scope="module")
def hybrid_base(tmp_path_factory):
    return finetune_base(tmp_path_factory, "hybrid", **HYBRID_MODEL)


def hybrid_args(base, runs: Path, name: str, *extra: str) -> list[str]:
    """lora_args with adapters on every projection of the hybrid (z and ba too), no dropout, a checkpoint
    every 2 steps."""
    targets = "lora.targets=[q,k,v,o,z,ba,gate,up,down]"
    a = lora_args(base, runs, name, "lora.dropout=0.0", "trainer.checkpoint_every=2", *extra)
    return [targets if x.startswith("lora.targets=") else x for x in a]


def test_lora_on_a_hybrid_trains_and_resumes_bit_exactly(hybrid_base, tmp_path, capsys):
    """LoRA on every projection of a Gated DeltaNet + softmax hybrid through the CLI: the adapters train
    (z's too), and 2 + 2 steps resumed give the 4 steps' rows and adapters bit for bit."""
    runs = tmp_path / "runs"
    code, _, err = run_main(capsys, *hybrid_args(hybrid_base, runs, "straight"))
    assert code == 0, err
    assert "LoRA: rank 4, alpha 16, dropout 0.0 on q, k, v, o, z, ba, gate, up, down" in err
    state = ckpt(runs / "straight")["state_dict"]
    # 9 targets in the linear layer, 7 in the softmax one; each A and B
    assert len(state) == 2 * (9 + 7)
    assert state["model.blocks.0.attn.in_proj_qkvz.lora_z_B"].abs().sum() > 0
    want = rows(runs / "straight")
    assert len({r["train/loss"] for r in want.values() if r.get("train/loss")}) == 4
    code, _, err = run_main(capsys, *hybrid_args(hybrid_base, runs, "halves", "trainer.stop_at_step=2"))
    assert code == 0, err
    code, _, err = run_main(capsys, "train", f"resume={runs / 'halves'}", "trainer.progress=false")
    assert code == 0, err
    assert rows(runs / "halves") == want
    halves = ckpt(runs / "halves")["state_dict"]
    assert halves.keys() == state.keys() and all(torch.equal(halves[k], state[k]) for k in state)


@pytest.mark.long
@pytest.mark.parametrize("finetune", ["lora", "qlora"])
def test_lora_on_a_hybrid_under_fsdp2_follows_one_process(hybrid_base, tmp_path, capsys, finetune):
    """FSDP2 on 2 processes (rank 1 builds the hybrid on the meta device; under QLoRA each rank keeps its rows
    of the NF4 projections, the linear layer's too) stopped at step 2 and resumed in one process follows one
    process's LoRA or QLoRA run on the hybrid."""
    if finetune == "qlora":
        pytest.importorskip("torchao", reason="the quant extra (torchao) is not installed")
    runs = tmp_path / "runs"

    # (QLoRA: scales in groups of 2 blocks, so that in_proj_ba's 4 blocks split over the 2 ranks)
    scaler = ("qlora.scaler_block_size=2",) if finetune == "qlora" else ()

    def args(name, *extra):
        a = hybrid_args(hybrid_base, runs, name, *scaler, *extra)
        return [f"finetune={finetune}" if x.startswith("finetune=") else x for x in a]

    code, _, err = run_main(capsys, *args("one"))
    assert code == 0, err
    fsdp = ("trainer=fsdp", "trainer.precision=32-true", "trainer.stop_at_step=2", *TWO_CPU_RANKS)
    err = run_group(*args("fsdp", *fsdp))
    # (that line is LoRA's: under QLoRA every rank reads and quantizes the base itself)
    assert ("start on the meta device" in err) == (finetune == "lora")
    resume_on_one_process(capsys, runs / "fsdp")
    one = {s: float(r["train/loss"]) for s, r in rows(runs / "one").items() if r.get("train/loss")}
    got = {s: float(r["train/loss"]) for s, r in rows(runs / "fsdp").items() if r.get("train/loss")}
    assert got.keys() == one.keys() and len(set(one.values())) == 4
    for s in one:
        assert abs(got[s] - one[s]) < 1e-5, (s, got[s], one[s])


@pytest.mark.long
def test_muon_trains_the_adapter_factors_resumes_exactly_and_shards_under_fsdp2(base, tmp_path, capsys):
    """optim=muon finetune=lora: Muon orthogonalizes each adapter factor (A [rank, in], B [rows, rank]) and
    nothing else trains. Its momentum is checkpointed with the adapters, so 2 + 2 steps resumed give the 4
    steps' rows and adapters bit for bit; FSDP2 on 2 processes (each factor's Newton-Schulz on one rank)
    follows one process to 1e-6 and its sharded checkpoint resumes in one process."""
    runs = tmp_path / "runs"
    common = ("optim=muon", "optim.muon.ns_dtype=float32")
    code, _, err = run_main(capsys, *lora_args(base, runs, "straight", *common))
    assert code == 0, err
    assert "Muon (torch.optim.Muon: " in err and "in 28 block matrices" in err
    assert "nothing else trains" in err
    saved = ckpt(runs / "straight")
    adapters_saved = saved["state_dict"]
    # A and B of 7 targets in 2 blocks: no base weight
    assert len(adapters_saved) == 28
    state = saved["optimizer_states"][0]["state"]
    assert len(state) == 28 and all(set(s) == {"momentum_buffer"} for s in state.values())
    want = rows(runs / "straight")
    # it trains
    assert len({r["train/loss"] for r in want.values() if r.get("train/loss")}) == 4
    code, _, err = run_main(capsys, *lora_args(base, runs, "halves", *common, "trainer.stop_at_step=2"))
    assert code == 0, err
    code, _, err = run_main(
        capsys, "train", f"resume={runs / 'halves'}", "trainer.progress=false", "trainer.threads=1"
    )
    assert code == 0, err
    assert rows(runs / "halves") == want
    halves = ckpt(runs / "halves")["state_dict"]
    assert all(torch.equal(halves[k], adapters_saved[k]) for k in adapters_saved)

    plain = ("lora.dropout=0.0", "trainer.max_steps=4", "trainer.checkpoint_every=2", *common)
    code, _, err = run_main(capsys, *lora_args(base, runs, "one", *plain))
    assert code == 0, err
    two = TWO_CPU_RANKS
    run_group(
        *lora_args(
            base,
            runs,
            "fsdp",
            *plain,
            "trainer=fsdp",
            "trainer.precision=32-true",
            "trainer.stop_at_step=2",
            *two,
        ),
    )
    resume_on_one_process(capsys, runs / "fsdp")
    one = {s: float(r["train/loss"]) for s, r in rows(runs / "one").items() if r.get("train/loss")}
    got = {s: float(r["train/loss"]) for s, r in rows(runs / "fsdp").items() if r.get("train/loss")}
    assert got.keys() == one.keys() and len(set(one.values())) == 4
    for s in one:
        assert abs(got[s] - one[s]) < 1e-6, (s, got[s], one[s])


def _loss_and_grads(model: GPT, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(x[:, :-1], x[:, 1:]).loss
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("what", ["compile", "kernels", "compile-gdn"])
def test_lora_under_compile_and_model_kernels_matches_eager(what):
    """torch.compile of each block (one graph, no break: fullgraph) and the fused kernels (norm, swiglu, rope
    under the Triton interpreter; the chunked loss) give eager's loss and adapter gradients; a hybrid's
    linear layer (its in_proj_qkvz adapted by parts) compiles too."""
    torch.manual_seed(0)
    x = torch.randint(0, 40, (2, 13))
    style, lora = (GDN, settings(targets=GDN_ALL)) if what == "compile-gdn" else (LLAMA, settings())
    eager = tiny(style)
    apply_lora(eager, lora)
    with torch.no_grad():
        for p in eager.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2)
    want_loss, want = _loss_and_grads(eager.train(), x)
    if what.startswith("compile"):
        other = eager
        # as trainer.compile=blocks does (there with inductor; a linear layer's backward under plain aot_eager
        # trips over eager strides its graph does not expect, inductor's decompositions do not)
        backend = "aot_eager_decomp_partition" if what == "compile-gdn" else "aot_eager"
        # (the hybrid's linear layer alone: its softmax layer is the case above's)
        for block in other.blocks[:1] if what == "compile-gdn" else other.blocks:
            block.compile(backend=backend, fullgraph=True)
    else:
        other = tiny(dict(LLAMA, kernels=["norm", "swiglu", "rope", "loss"]))
        apply_lora(other, settings())
        other.load_state_dict(eager.state_dict())
    got_loss, got = _loss_and_grads(other.train(), x)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=0)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4)
    # the base under compile too (a guard recompiles)
    with torch.no_grad(), adapters_disabled(other):
        base = tiny(dict(style, kernels=other.cfg.kernels))
        # (the linear layer's fp32 delta rule, decomposed: 2.6e-5 apart here)
        atol = 1e-4 if what == "compile-gdn" else 1e-5
        torch.testing.assert_close(other(x).logits, base(x).logits, atol=atol, rtol=0)


def test_a_moved_or_changed_base_is_one_line(tmp_path, capsys):
    """The adapters fit only the weights they were trained on: a base checkpoint that changed since (or is
    gone) stops sample/export with one line naming it."""
    base_run, model, _ = make_run(tmp_path, max_seq_len=32)
    run, _ = lora_run_by_hand(base_run, tmp_path / "lora-run", ["q", "v"])
    base_ckpt = base_run / "checkpoints" / "last.ckpt"
    state = torch.load(base_ckpt, weights_only=True)
    state["state_dict"]["model.final_norm.weight"] = state["state_dict"]["model.final_norm.weight"] * 2
    torch.save(state, base_ckpt)
    code, _, err = run_main(capsys, "sample", f"run={run}", "prompt=ROMEO:", "max_new_tokens=2")
    assert code == 2 and "whose content changed since the LoRA run started" in err, err
    base_ckpt.unlink()
    code, _, err = run_main(capsys, "export", f"run={run}", f"out={tmp_path / 'hf'}")
    assert code == 2 and "which is gone" in err and not (tmp_path / "hf").exists(), err


def test_the_memory_estimate_counts_gradients_and_adam_of_the_adapters_only():
    """check_host_memory must not refuse a LoRA run for the full fine-tune's gradients and AdamW moments."""
    from types import SimpleNamespace

    from gptkit.training.memory import estimate

    model = tiny(LLAMA)
    plan = estimate_plan(model.cfg)
    full = estimate(plan)
    lora = estimate(SimpleNamespace(**{**vars(plan), "lora": settings()}))
    k = apply_lora(model, settings())
    n = sum(p.numel() for p in model.parameters()) - k
    approx = pytest.approx
    assert full["gradients"] == 4 * n and lora["gradients"] == approx(4 * k)
    assert lora["optimizer"] == approx(8 * k)
    assert lora["weights"] == approx(4 * (n + k)) and lora["activations"] == full["activations"]
    assert lora["total"] == approx(sum(v for key, v in lora.items() if key != "total"))
    assert lora["total"] < full["total"]
