"""The LightningModule's training decisions applied to the pure model: activation checkpointing."""

import torch
from conftest import TINY_LLAMA

from gptkit.model import GPT, ModelConfig
from gptkit.training.module import apply_activation_checkpointing

# 3 layers
CFG = ModelConfig(**(TINY_LLAMA | dict(n_layers=3)), vocab_size=64, max_seq_len=16, attention="eager")


def _saved_tensors(model, x, y) -> int:
    n = 0

    def pack(t):
        nonlocal n
        n += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y).loss
    loss.backward()
    return n


def test_activation_checkpointing_recomputes_blocks_with_the_same_gradients_and_names():
    torch.manual_seed(0)
    plain = GPT(CFG)
    ckpt = GPT(CFG)
    ckpt.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(ckpt)
    # checkpoints are unchanged
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    saved_plain, saved_ckpt = _saved_tensors(plain, x, y), _saved_tensors(ckpt, x, y)
    # only block inputs are kept
    assert saved_ckpt < saved_plain / 2
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    # evaluation does not go through the checkpoint
    with torch.no_grad():
        torch.testing.assert_close(ckpt.eval()(x).logits, plain.eval()(x).logits)


def test_selective_checkpointing_and_offload_keep_less_with_the_same_loss_and_gradients():
    """trainer.activation_checkpointing=full|selective (ops, attention, layers) and activation_offload: the
    same loss and gradients as the plain run (to 1e-6), and what the forward keeps alive, measured by the
    CPU allocator's own records (step_memory), below the plain run's in the policies' order."""
    from gptkit.training import activations

    cfg = ModelConfig(**(TINY_LLAMA | dict(n_layers=4)), vocab_size=64, max_seq_len=64)
    torch.manual_seed(0)
    state = GPT(cfg).state_dict()
    x, y = torch.randint(0, 64, (2, 64)), torch.randint(0, 64, (2, 64))
    runs, moved = {}, {}
    for name, kw in {
        "plain": dict(mode=None),
        "full": dict(mode="full"),
        "ops": dict(mode="selective", policy="ops", every=2),
        "attention": dict(mode="selective", policy="attention"),
        "layers": dict(mode="selective", policy="layers", every=2),
        "offload": dict(mode=None, offload=True),
        # the copies and views a GPU's offload makes, made on the CPU
        "offload copied": dict(mode=None, offload=True, copy_host=True),
        "full offload copied": dict(mode="full", offload=True, copy_host=True),
    }.items():
        model = GPT(cfg)
        model.load_state_dict(state)
        counts = activations.apply(model, **kw)
        runs[name] = (activations.step_memory(lambda: model(x, y).loss), model)
        moved[name] = counts["moved"] + counts["on_host"]
    plain, plain_model = runs["plain"]
    for name, (mem, model) in runs.items():
        assert abs(mem["loss"] - plain["loss"]) <= 1e-6, name
        for (p, a), b in zip(plain_model.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=f"{name} {p}")
    kept = {name: mem["kept"] for name, (mem, _) in runs.items()}
    assert kept["full"] < kept["attention"] < kept["ops"] < kept["layers"] < kept["plain"], kept
    # on the CPU the activations are on the host already: offloading moves nothing and keeps the same
    assert kept["offload"] == kept["plain"]
    assert runs["full"][0]["peak"] < plain["peak"]
    # each storage once: what offloading moves is at most what the plain forward keeps
    assert 0 < moved["offload copied"] == moved["offload"] <= kept["plain"]
    assert 0 < moved["full offload copied"] < moved["offload"]


def test_checkpointing_values_are_one_line_errors():
    from omegaconf import OmegaConf

    from gptkit.errors import ConfigError
    from gptkit.training.config_checks import checkpointing_mode

    def mode(**t):
        return checkpointing_mode(OmegaConf.create(t))

    assert [mode(activation_checkpointing=v) for v in (False, True, "full", "selective")] == [
        None,
        "full",
        "full",
        "selective",
    ]
    for bad, says in (
        (dict(activation_checkpointing="some"), "not one of none (= false), full (= true), selective"),
        (dict(activation_checkpointing_policy="mm"), "policy=mm is not one of ops, attention, layers"),
        (dict(activation_checkpointing_every=0), "every=0 must be an integer >= 1"),
        (dict(activation_offload="yes"), "activation_offload=yes must be true or false"),
    ):
        try:
            mode(**bad)
        except ConfigError as e:
            assert says in str(e) and "\n" not in str(e)
        else:
            raise AssertionError(bad)


def test_the_run_plans_estimate_takes_the_mesh_and_refuses_one_that_does_not_divide():
    """trainer.tensor_parallel x trainer.context_parallel: the estimate train, preflight and the
    out-of-memory line read divides the activations by tp x cp; a mesh larger than the world is one line."""
    from types import SimpleNamespace

    import pytest
    from conftest import estimate_plan

    from gptkit.errors import ConfigError
    from gptkit.training.memory import estimate

    cfg = ModelConfig(**TINY_LLAMA, vocab_size=64, max_seq_len=16)

    def plan(**mesh):
        p = estimate_plan(cfg, world_size=4)
        p.shards = 4
        p.trainer = SimpleNamespace(activation_checkpointing="selective", **mesh)
        return p

    flat, split = estimate(plan()), estimate(plan(tensor_parallel=2, context_parallel=2))
    assert split["activations"] * 4 == pytest.approx(flat["activations"])
    assert split["logits"] * 4 == pytest.approx(flat["logits"])
    with pytest.raises(
        ConfigError,
        match=r"trainer.tensor_parallel=4 x trainer.context_parallel=2 = 8 GPUs "
        r"is a mesh larger than the world, trainer.devices x trainer.num_nodes=4",
    ):
        estimate(plan(tensor_parallel=4, context_parallel=2))
