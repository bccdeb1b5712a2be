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
