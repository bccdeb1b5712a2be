"""finetune=qlora (gptkit/training/finetune/qlora.py, gptkit/quant.py): LoRA's adapters on an NF4 base built
on the meta device and quantized from the base checkpoint; adapters-only checkpoints resumed bit for bit,
merged export of dequantize(NF4(W)) + the adapters, PEFT export; DDP and FSDP2 (NF4 shards) against one
process; torch.compile in one graph; DPO; bad input in one line."""

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import (
    TWO_CPU_RANKS,
    exports,
    finetune_args,
    finetune_base,
    one_line,
    resume_on_one_process,
    run_group,
    run_main,
)

from gptkit import quant
from gptkit.adapters import CHECKPOINT_KEY, is_adapter_key
from gptkit.model import GPT
from gptkit.training.finetune.lora import apply_lora

pytest.importorskip("torchao", reason="the quant extra (torchao) is not installed")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return finetune_base(tmp_path_factory, "qbase")


def qlora_args(base, runs: Path, name: str, *extra: str) -> list[str]:
    return finetune_args(base, runs, name, *extra, finetune="qlora", val_every=4)


def losses(run: Path) -> dict[int, float]:
    with open(run / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def rows(run: Path) -> list[dict[str, str]]:
    kept = ("step", "train/loss", "val/loss", "train/lr", "train/grad_norm")
    with open(run / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k in kept} for r in csv.DictReader(f)]


def ckpt(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def qlora_model(base_run: Path, adapters: dict, lora: dict, nf4: bool = True) -> GPT:
    """The model a QLoRA run trains, built by hand: the base's projections NF4 (torchao, blocks of 64; nf4
    False: the full-precision base), the run's adapters beside them."""
    from gptkit.runs import load_model

    *_, model = load_model(base_run)
    apply_lora(model, lora)
    model.load_state_dict({k.removeprefix("model."): v for k, v in adapters.items()}, strict=False)
    for name in quant.quantized_names(model.cfg) if nf4 else ():
        linear = model.get_submodule(name.removesuffix(".weight"))
        linear.weight = torch.nn.Parameter(quant.to_nf4(linear.weight.detach()), requires_grad=False)
    return model.eval()


def test_the_model_is_built_on_meta_and_materialized_with_nf4_projections(base, tmp_path):
    """LitGPT builds the model on the meta device; materialize() puts the base in: every block projection
    is torchao's NF4 of the checkpoint's weight (bit for bit), everything else the checkpoint's, the
    adapters A from the seeded generator and B zeros, nothing else trainable."""
    import gptkit
    from gptkit.training.module import LitGPT

    plan = gptkit.plan(qlora_args(base, tmp_path / "runs", "plan")[1:])
    module = LitGPT(plan)
    assert module.built_on_meta and all(p.is_meta for p in module.model.parameters())
    module.finetune.materialize(module, torch.device("cpu"))
    state = torch.load(base[0] / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    names = quant.quantized_names(module.model.cfg)
    assert len(names) == 2 * 5
    for name, p in module.model.named_parameters():
        assert not p.is_meta and p.requires_grad == is_adapter_key(name), name
        if name in names:
            assert quant.is_nf4(p), name
            want = quant.to_nf4(state["model." + name]).get_original_weight()
            assert torch.equal(p.get_original_weight(), want), name
        elif name.endswith("_B"):
            assert not p.any()
        elif not name.endswith("_A"):
            assert torch.equal(p, state["model." + name]), name
    x = torch.randint(0, plan.model.vocab_size, (2, 16))
    by_hand = qlora_model(base[0], {}, plan.lora)
    with torch.no_grad():
        torch.testing.assert_close(module.model.eval()(x).logits, by_hand(x).logits, atol=1e-6, rtol=0)


def test_qlora_trains_resumes_exactly_and_exports_the_base_it_trained_on(base, tmp_path, capsys):
    """4 steps straight and 2 + resume 2 (dropout on) log the same rows and save the same adapters; the
    checkpoint holds the adapters and the record of the NF4 base; `export` writes dequantize(NF4(W)) + the
    adapters, whose logits are the QLoRA model's; `export adapters=true` loads in PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    runs = tmp_path / "runs"
    every = ("lora.dropout=0.1", "trainer.val_every=2")
    code, _, err = run_main(capsys, *qlora_args(base, runs, "straight", *every))
    assert code == 0, err
    assert "QLoRA: rank 4, alpha 16" in err and "block projections NF4 (blocks of 64" in err
    saved = ckpt(runs / "straight")
    state = saved["state_dict"]
    assert len(state) == 2 * 7 * 2 and all(is_adapter_key(k.removeprefix("model.")) for k in state)
    record = saved[CHECKPOINT_KEY]
    assert record["finetune"] == "qlora" and record["quantized"]["block_size"] == 64
    assert len(saved["optimizer_states"][0]["state"]) == len(state)
    code, _, err = run_main(capsys, *qlora_args(base, runs, "halves", *every, "trainer.stop_at_step=2"))
    assert code == 0, err
    code, _, err = run_main(capsys, "train", f"resume={runs / 'halves'}", "trainer.progress=false")
    assert code == 0, err
    want = rows(runs / "straight")
    assert len({r["train/loss"] for r in want}) == 4 and rows(runs / "halves") == want
    halves = ckpt(runs / "halves")["state_dict"]
    assert all(torch.equal(halves[k], state[k]) for k in state)

    # the QLoRA model (NF4 base + adapters) against the merged export, through transformers; PEFT's adapters
    # on the full-precision base against the same adapters on it in gptkit
    lora = {k: record[k] for k in ("rank", "alpha", "dropout", "targets")}
    unmerged = qlora_model(base[0], state, lora)
    on_full = qlora_model(base[0], state, lora, nf4=False)
    out = exports(
        capsys,
        [f"run={runs / 'straight'}", f"out={tmp_path / 'merged'}"],
        [f"run={base[0]}", f"out={tmp_path / 'hf-base'}"],
        [f"run={runs / 'straight'}", f"out={tmp_path / 'adapter'}", "adapters=true"],
    )
    assert "they trained on the NF4-quantized base" in out
    x = torch.randint(0, unmerged.cfg.vocab_size, (2, 20))
    with torch.no_grad():
        ours = unmerged(x).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(x).logits
        hf_base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base").eval()
        plain = hf_base(x).logits
        peft = PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()(x).logits
    torch.testing.assert_close(merged, ours, atol=1e-4, rtol=0)
    # the adapters trained, and the NF4 base is not the full one: both differences are real
    assert (merged - plain).abs().max() > 1e-3 and (on_full(x).logits - ours).abs().max() > 1e-3
    torch.testing.assert_close(peft, on_full(x).logits, atol=1e-4, rtol=0)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4

    # a resume may not change the quantization its adapters trained on
    code, _, err = run_main(capsys, "train", f"resume={runs / 'straight'}", "qlora.block_size=32")
    assert code == 2 and one_line(err) and "continues adapters with qlora.block_size=64" in err, err


@pytest.mark.long
def test_qlora_on_ddp_and_fsdp2_follows_one_process(base, tmp_path, capsys):
    """2 CPU processes (gloo), the same global batch: DDP (the NF4 weights neither broadcast nor reduced) and
    FSDP2 (each rank quantizes the full weight and keeps its rows: NF4 shards) log one process's losses; the
    sharded adapters-only checkpoint resumes in one process (where FSDP2 leaves the NF4 weights whole)."""
    runs = tmp_path / "runs"
    # FSDP2 splits each projection's groups of scales between 2 ranks: 8 scales a group; 3 steps, the
    # sharded checkpoint after the first
    common = ("qlora.scaler_block_size=8", "trainer.max_steps=3", "trainer.checkpoint_every=1")
    code, _, err = run_main(capsys, *qlora_args(base, runs, "one", *common))
    assert code == 0, err
    want = losses(runs / "one")
    assert len(set(want.values())) == 3
    two = TWO_CPU_RANKS
    for name, extra in (
        ("ddp", ("trainer=ddp",)),
        ("fsdp", ("trainer=fsdp", "trainer.precision=32-true", "trainer.stop_at_step=1")),
    ):
        r = run_group("-m", "gptkit", *qlora_args(base, runs, name, *common, *extra, *two))
        assert r.returncode == 0, r.stderr[-3000:]
    assert (runs / "fsdp" / "checkpoints" / "step-000001.ckpt" / ".metadata").is_file()
    resume_on_one_process(capsys, runs / "fsdp")
    for name in ("ddp", "fsdp"):
        got = losses(runs / name)
        assert got.keys() == want.keys(), (name, got)
        for s in want:
            assert abs(got[s] - want[s]) < 1e-5, (name, s, got[s], want[s])


def test_qlora_compiles_in_one_graph_and_its_reference_is_the_nf4_base():
    """torch.compile of each block with NF4 weights and adapters inside (fullgraph: no break) gives eager's
    loss and adapter gradients; adapters_disabled gives the NF4 base (DPO's reference, no copy)."""
    from gptkit.model import ModelConfig
    from gptkit.training.finetune.lora import adapters_disabled

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40,
        max_seq_len=16,
        n_layers=1,
        n_heads=4,
        d_model=32,
        init_std=0.3,
        mlp="swiglu",
        norm="rmsnorm",
        bias=False,
        n_kv_heads=2,
        # issue 49's blocks: the sinks and the output gate stay unquantized and frozen, as the norms
        attn_sinks=True,
        attn_output_gate=True,
    )
    model = GPT(cfg)
    apply_lora(model, {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q", "v", "o", "down"]})
    assert "blocks.0.attn.gate_proj.weight" not in quant.quantized_names(cfg)
    base = {}
    for name in quant.quantized_names(cfg):
        linear = model.get_submodule(name.removesuffix(".weight"))
        linear.weight = torch.nn.Parameter(quant.to_nf4(linear.weight.detach()), requires_grad=False)
        base[name] = linear.weight.get_original_weight()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2)
    x = torch.randint(0, 40, (2, 13))

    def loss_and_grads():
        model.zero_grad()
        loss = model(x[:, :-1], x[:, 1:]).loss
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}

    want_loss, want = loss_and_grads()
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    got_loss, got = loss_and_grads()
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=0)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4)
    plain = GPT(cfg)
    plain.load_state_dict({**{k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}, **base})
    with torch.no_grad(), adapters_disabled(model):
        torch.testing.assert_close(model(x).logits, plain(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (
            ["~init_from"],
            "finetune=qlora trains adapters on frozen weights, so it needs the weights to start",
        ),
        (
            ["qlora.block_size=48"],
            "qlora.block_size=48 does not divide blocks.0.attn.qkv_proj.weight [64, 32]",
        ),
        (["qlora.block_size=7"], "qlora.block_size=7 must be an even integer >= 2"),
        (["qlora.scaler_block_size=3"], "qlora.scaler_block_size=3 does not divide the 32 blocks of"),
        (
            ["trainer=fsdp", "trainer.devices=2"],
            "trainer=fsdp over 2 processes shards blocks.0.attn.qkv_proj",
        ),
        (["torchao"], "need torchao, which is not installed: pip install 'gptkit[quant]' (torchao==0.18.0)"),
    ],
    ids=["no-init", "block", "odd-block", "scaler", "fsdp-split", "no-torchao"],
)
def test_bad_qlora_input_is_one_line_before_anything_is_written(
    base, tmp_path, capsys, monkeypatch, extra, needle
):
    args = qlora_args(base, tmp_path / "runs", "bad", "trainer.accelerator=cpu")
    if extra == ["~init_from"]:
        args = [a for a in args if not a.startswith("init_from=")]
    elif extra == ["torchao"]:
        import importlib.util

        find = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else find(n, *a)
        )
    else:
        args += extra
    code, _, err = run_main(capsys, *args)
    assert code == 2 and one_line(err) and needle in err, err
    assert not (tmp_path / "runs").exists()


def test_a_mixture_of_experts_has_no_nf4_base():
    from gptkit.errors import ConfigError
    from gptkit.model import ModelConfig

    cfg = ModelConfig(
        vocab_size=40,
        max_seq_len=16,
        n_layers=2,
        n_heads=4,
        d_model=32,
        mlp="swiglu",
        moe=dict(n_experts=4, top_k=2, d_expert=24),
    )
    with pytest.raises(
        ConfigError, match="a mixture of experts .* which torchao's NF4/int8/int4 weights do not"
    ):
        quant.check_nf4(cfg, 64, "auto")


MLA_SHAPE = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_mla_projections_quantize_and_decode_through_the_latent_cache_as_recomputed(kind):
    """Multi-head latent attention's projections are quantized (kv_b_proj too): the absorbed decoding path
    reads kv_b_proj dequantized, so the cached decode's logits are the quantized model's full forward."""
    from gptkit.model import ModelConfig
    from gptkit.model.kv_cache import KVCache

    cfg = ModelConfig(
        vocab_size=40,
        max_seq_len=16,
        n_layers=2,
        n_heads=4,
        d_model=32,
        mlp="swiglu",
        norm="rmsnorm",
        attention_kind="mla",
        mla=MLA_SHAPE,
        init_std=0.3,
    )
    names = quant.quantized_names(cfg)
    attn = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    assert sorted(names) == sorted(
        f"blocks.{i}.{m}.weight"
        for i in (0, 1)
        for m in [f"attn.{a}" for a in attn] + ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    )
    assert names["blocks.0.attn.kv_b_proj.weight"] == (4 * 16, 16)
    quant.check_nf4(cfg, 64, "auto")
    torch.manual_seed(0)
    model = quant.quantize_model(GPT(cfg).eval(), kind)
    assert type(model.blocks[1].attn.kv_b_proj.weight) not in (torch.Tensor, torch.nn.Parameter)
    x = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        full = model(x).logits
        cache = KVCache(cfg, batch_size=2)
        got = [model(x[:, :5], cache=cache).logits]
        got += [model(x[:, t : t + 1], cache=cache).logits for t in range(5, 12)]
    # int8 on the CPU: a decode step of <= 32 rows runs torch's int8 kernel on bf16 activations
    # (gptkit/quant_int8.py), so the two paths agree to bf16 rounding carried through two layers, not fp32's
    atol = 1e-4 if kind == "nf4" else 2**-5 * float(full.abs().max())
    torch.testing.assert_close(torch.cat(got, dim=1), full, atol=atol, rtol=0)


def test_qlora_trains_on_mla_tiny_and_samples_merged(tmp_path, capsys):
    """finetune=qlora on mla-tiny (shrunk): every MLA projection NF4 with adapters on q_a, q_b, kv_a, kv_b, o
    and the MLP; the adapters move; sample merges them into the NF4 base and decodes through the latent
    cache; quantize=nf4 samples the base."""
    from conftest import tiny_run, write_corpus

    import gptkit

    corpus = write_corpus(tmp_path, 8_000)
    runs = tmp_path / "runs"
    shape = [f"model.mla.{k}={v}" for k, v in MLA_SHAPE.items()]
    gptkit.train(tiny_run(corpus, runs, "base", *shape, model="mla-tiny", steps=2, val_every=2))
    targets = "lora.targets=[q_a,q_b,kv_a,kv_b,o,gate,up,down]"
    code, _, err = run_main(
        capsys, *qlora_args((runs / "base", corpus), runs, "q", targets, "trainer.max_steps=3")
    )
    assert code == 0, err
    assert "QLoRA: rank 4, alpha 16, dropout 0.0 on q_a, q_b, kv_a, kv_b, o, gate, up, down" in err
    state = ckpt(runs / "q")["state_dict"]
    assert state["model.blocks.0.attn.kv_b_proj.lora_kv_b_B"].abs().sum() > 0
    for run, extra in ((runs / "q", []), (runs / "base", ["quantize=nf4"])):
        code, out, err = run_main(capsys, "sample", f"run={run}", "prompt=the", "max_new_tokens=6", *extra)
        assert code == 0 and out.strip(), err
    # no family writes DeepSeek-V3 yet: the PEFT export of MLA adapters is refused in one line
    code, _, err = run_main(capsys, "export", f"run={runs / 'q'}", f"out={tmp_path / 'ad'}", "adapters=true")
    assert code == 2 and one_line(err) and "mla" in err, err
    assert not (tmp_path / "ad").exists()


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_hybrids_linear_layer_projections_quantize_and_decode_through_the_state_as_recomputed(kind):
    """A Gated DeltaNet layer's 2-D projections (in_proj_qkvz, in_proj_ba, out_proj) are quantized as the
    softmax layer's; A_log, dt_bias, the conv1d's taps and the norms are not. The quantized hybrid decodes
    through its recurrent state as it computes whole."""
    from conftest import HYBRID_MODEL

    from gptkit.model import ModelConfig
    from gptkit.model.kv_cache import KVCache

    cfg = ModelConfig(
        vocab_size=40, max_seq_len=16, n_layers=2, n_heads=4, d_model=32, mlp="swiglu", norm="rmsnorm",
        init_std=0.3, **HYBRID_MODEL,
    )  # fmt: skip
    names = quant.quantized_names(cfg)
    mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert sorted(names) == sorted(
        [f"blocks.0.{m}.weight" for m in ["attn.in_proj_qkvz", "attn.in_proj_ba", "attn.out_proj", *mlp]]
        + [f"blocks.1.{m}.weight" for m in ["attn.qkv_proj", "attn.o_proj", *mlp]]
    )
    # 2 key heads of q, k (8) and 4 value heads of v, z (8); b and a per value head
    assert names["blocks.0.attn.in_proj_qkvz.weight"] == (2 * 16 + 2 * 32, 32)
    assert names["blocks.0.attn.in_proj_ba.weight"] == (8, 32)
    assert names["blocks.0.attn.out_proj.weight"] == (32, 32)
    quant.check_nf4(cfg, 64, "auto")
    torch.manual_seed(0)
    model = quant.quantize_model(GPT(cfg).eval(), kind)
    attn = model.blocks[0].attn
    for linear in (attn.in_proj_qkvz, attn.in_proj_ba, attn.out_proj):
        assert type(linear.weight) not in (torch.Tensor, torch.nn.Parameter)
    for p in (attn.A_log, attn.dt_bias, attn.conv1d.weight, attn.norm.weight):
        assert type(p) is torch.nn.Parameter and p.dtype == torch.float32
    x = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        full = model(x).logits
        cache = KVCache(cfg, batch_size=2)
        got = [model(x[:, :5], cache=cache).logits]
        got += [model(x[:, t : t + 1], cache=cache).logits for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(got, dim=1), full, atol=1e-4, rtol=0)


def test_a_split_layout_linear_layer_quantizes_its_four_projections_and_decodes_as_recomputed():
    """Under model.gdn.layout=split (Qwen3.5's) the linear layer's in_proj_qkv, in_proj_z, in_proj_b and
    in_proj_a are quantized (not the grouped layout's names, which this layer lacks), and it decodes through
    its state as it computes whole."""
    from conftest import HYBRID_MODEL

    from gptkit.model import ModelConfig
    from gptkit.model.kv_cache import KVCache

    split = dict(HYBRID_MODEL, gdn=dict(HYBRID_MODEL["gdn"], layout="split"))
    cfg = ModelConfig(
        vocab_size=40, max_seq_len=16, n_layers=2, n_heads=4, d_model=32, mlp="swiglu", norm="rmsnorm",
        init_std=0.3, **split,
    )  # fmt: skip
    names = quant.quantized_names(cfg)
    linear = {k: v for k, v in names.items() if k.startswith("blocks.0.attn.")}
    assert linear == {
        "blocks.0.attn.in_proj_qkv.weight": (2 * 16 + 32, 32),
        "blocks.0.attn.in_proj_z.weight": (32, 32),
        "blocks.0.attn.in_proj_b.weight": (4, 32),
        "blocks.0.attn.in_proj_a.weight": (4, 32),
        "blocks.0.attn.out_proj.weight": (32, 32),
    }
    torch.manual_seed(0)
    model = quant.quantize_model(GPT(cfg).eval(), "int8")
    attn = model.blocks[0].attn
    for linear in (attn.in_proj_qkv, attn.in_proj_z, attn.in_proj_b, attn.in_proj_a, attn.out_proj):
        assert type(linear.weight) not in (torch.Tensor, torch.nn.Parameter)
    x = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        full = model(x).logits
        cache = KVCache(cfg, batch_size=2)
        got = [model(x[:, :5], cache=cache).logits]
        got += [model(x[:, t : t + 1], cache=cache).logits for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(got, dim=1), full, atol=1e-4, rtol=0)


def test_qlora_trains_on_a_hybrid_and_samples_merged_and_quantized(tmp_path, capsys, tmp_path_factory):
    """finetune=qlora on a Gated DeltaNet + softmax hybrid: every 2-D projection NF4 (the linear layer's too),
    adapters on all of them (z and ba included) train; sample merges them into the NF4 base, quantize=nf4
    samples the base."""
    from conftest import HYBRID_MODEL

    base = finetune_base(tmp_path_factory, "qhybrid", **HYBRID_MODEL)
    runs = tmp_path / "runs"
    targets = "lora.targets=[q,k,v,o,z,ba,gate,up,down]"
    args = [targets if a.startswith("lora.targets=") else a for a in qlora_args(base, runs, "q")]
    code, _, err = run_main(capsys, *args)
    assert code == 0, err
    assert "QLoRA: rank 4, alpha 16, dropout 0.0 on q, k, v, o, z, ba, gate, up, down" in err
    assert len(set(losses(runs / "q").values())) == 4
    state = ckpt(runs / "q")["state_dict"]
    assert all(is_adapter_key(k.removeprefix("model.")) for k in state)
    for t in ("q", "z"):
        assert state[f"model.blocks.0.attn.in_proj_qkvz.lora_{t}_B"].abs().sum() > 0
    assert state["model.blocks.0.attn.in_proj_ba.lora_ba_B"].abs().sum() > 0
    for run, extra in ((runs / "q", []), (base[0], ["quantize=nf4"])):
        code, out, err = run_main(capsys, "sample", f"run={run}", "prompt=the", "max_new_tokens=6", *extra)
        assert code == 0 and out.strip(), err
