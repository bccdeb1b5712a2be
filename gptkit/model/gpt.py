"""The pre-norm decoder-only transformer (GPT-2 and Llama style), as one torch.nn.Module.

    idx [B, T] -> tok_emb (x sqrt(d_model): scale_embeddings) (+ pos_emb) -> n_layers x Block -> final_norm
               -> lm_head (-> logit_softcap * tanh(logits / logit_softcap)) -> logits [B, T, V]
    Block (norm_placement=pre):       x = x + attn(attn_norm(x));  x = x + mlp(mlp_norm(x))
    Block (norm_placement=post):      x = x + attn_norm(attn(x));  x = x + mlp_norm(mlp(x))   (OLMo-2)
    Block (norm_placement=sandwich):  x = x + attn_post_norm(attn(attn_norm(x)));
                                      x = x + mlp_post_norm(mlp(mlp_norm(x)))                (Gemma 2, 3)

A layer's attention is global or local (model.layer_types: a sliding window of model.sliding_window
positions); with model.rope_local_theta the local layers rotate with their own RoPE (rope_local); the
layers of model.nope_layers rotate with none (NoPE).

`attn` is the block's attention, whichever kind the config gives that layer (gptkit/model/attention_kinds.py:
today multi-head attention with grouped K/V heads, gptkit/model/mha.py).
`mlp` is the block's feed-forward, whichever kind the config gives that layer (gptkit/model/feedforward.py:
dense GELU or SwiGLU, or a mixture of experts); what it returns beside its output (an auxiliary loss and
figures, in training) is summed over the layers into GPTOutput.aux.

Labels are NOT shifted inside: pass `targets` already aligned with the logits
(targets[:, t] is the token that follows idx[:, t]).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from gptkit.model import fused
from gptkit.model.attention_kinds import make_attention
from gptkit.model.config import ModelConfig
from gptkit.model.documents import Documents
from gptkit.model.feedforward import ModelAux, combine, make_feed_forward
from gptkit.model.kv_cache import KVCache
from gptkit.model.layers import LayerNorm, RMSNorm, RotaryEmbedding, make_norm
from gptkit.model.mtp import MultiTokenPrediction


class GPTOutput(NamedTuple):
    logits: Optional[torch.Tensor]  # [B, T_kept, vocab_size]; None with the fused loss (model.kernels: loss)
    # scalar fp32 mean cross-entropy, when targets are given
    loss: Optional[torch.Tensor]
    # per layer [B, n_heads, T, T], when asked for
    attentions: Optional[list[torch.Tensor]]
    # the feed-forwards' auxiliary loss and figures (training; None when no layer has any)
    aux: Optional[ModelAux] = None
    # each multi-token prediction depth's fp32 mean cross-entropy (model.mtp; asked for: forward(mtp=True))
    mtp_losses: Optional[tuple[torch.Tensor, ...]] = None
    # [B, T] fp32 log-probs of the targets (0 where -100), asked for: forward(token_logps=True); logits None
    logps: Optional[torch.Tensor] = None
    # [B] fp32: the score head on the hidden state at each row's score_at position (model.score_head)
    scores: Optional[torch.Tensor] = None
    # what forward(head=f) returned: f(final hidden states, lm_head.weight, logit_softcap); logits None
    head: Any = None


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        norm = dict(dim=cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias, fused="norm" in cfg.kernels)
        self.attn_norm = make_norm(cfg.norm, **norm)
        # y, probs = attn(x, ...): the attention seam (model.attention_kind)
        self.attn = make_attention(cfg, layer)
        # the MLP's pre-norm
        self.mlp_norm = make_norm(cfg.norm, **norm)
        # y, aux = mlp(x): the feed-forward seam
        self.mlp = make_feed_forward(cfg, layer)
        self.dropout = cfg.dropout
        self.post_norm = cfg.norm_placement == "post"
        # sandwich: a second norm on each branch's output (before the residual add)
        self.sandwich = cfg.norm_placement == "sandwich"
        if self.sandwich:
            self.attn_post_norm = make_norm(cfg.norm, **norm)
            self.mlp_post_norm = make_norm(cfg.norm, **norm)

    def forward(self, x, *, rope=None, cache=None, positions=0, docs=None, return_probs=False):
        """x [B, T, d_model] -> (x + attention + MLP, the attention probabilities or None, the MLP's LayerAux
        or None)."""
        # the norms act on each branch's output, the residual stream is never normalized
        if self.post_norm:
            a, probs = self.attn(
                x, rope=rope, cache=cache, positions=positions, docs=docs, return_probs=return_probs
            )
            x = x + self.attn_norm(a)
            m, aux = self.mlp(x)
            return x + self._drop(self.mlp_norm(m)), probs, aux
        a, probs = self.attn(
            self.attn_norm(x),
            rope=rope,
            cache=cache,
            positions=positions,
            docs=docs,
            return_probs=return_probs,
        )
        if self.sandwich:
            a = self.attn_post_norm(a)
        x = x + a
        m, aux = self.mlp(self.mlp_norm(x))
        if self.sandwich:
            m = self.mlp_post_norm(m)
        x = x + self._drop(m)
        return x, probs, aux

    def _drop(self, m: torch.Tensor) -> torch.Tensor:
        """The branch's dropout (training with model.dropout > 0; else m itself, without a call per layer)."""
        return F.dropout(m, self.dropout, True) if self.training and self.dropout else m


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.rope = (
            RotaryEmbedding(
                cfg.rope_dim,
                max_seq_len=cfg.max_seq_len,
                theta=cfg.rope_theta,
                fused="rope" in cfg.kernels,
                scaling=cfg.rope_scaling,
            )
            if cfg.position == "rope"
            else None
        )
        # the local layers' own RoPE (model.rope_local_theta: plain, another base)
        self.rope_local = (
            RotaryEmbedding(cfg.rope_dim, cfg.max_seq_len, cfg.rope_local_theta, fused="rope" in cfg.kernels)
            if cfg.rope_local_theta is not None and cfg.position == "rope"
            else None
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = make_norm(
            cfg.norm, dim=cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias, fused="norm" in cfg.kernels
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # model.mtp: the multi-token prediction modules (gptkit/model/mtp.py), run by forward(mtp=True) only
        self.mtp = MultiTokenPrediction(cfg, Block) if cfg.mtp_depth else None
        # model.score_head: a reward model's scalar head (transformers' *ForSequenceClassification `score`)
        self.score = nn.Linear(cfg.d_model, 1, bias=False) if cfg.score_head else None
        self.reset_parameters()
        if self.score is not None and not cfg.tie_embeddings:
            # a reward model's scores never read its own LM head: frozen, kept as it was (DDP refuses a
            # trained weight that gets no gradient)
            self.lm_head.weight.requires_grad_(False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, init_std) for weights, zero biases, residual projections scaled
        by 1/sqrt(2 * n_layers) (two residual adds per block)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            # attn_norm, mlp_norm, final_norm, q_norm, k_norm, *_post_norm: the identity (their own rule)
            if "_norm." in name:
                continue
            # a mixture's expert biases: experts.gate_bias, up_bias, down_bias
            elif name.endswith((".bias", "_bias")):
                p.zero_()
            # a mixture's experts: down_proj [E, d_model, d_expert]
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                p.normal_(0.0, std)
        for m in self.modules():
            if isinstance(m, (LayerNorm, RMSNorm)):
                m.reset_parameters()
            # a module whose parameters follow a rule of their own (Gated DeltaNet's A_log, dt_bias, conv1d)
            elif hasattr(m, "init_own_parameters"):
                m.init_own_parameters()

    def forward(
        self,
        idx: torch.Tensor,  # [B, T] token ids
        targets: Optional[torch.Tensor] = None,  # [B, T], already shifted; -100 = ignore
        *,
        doc_ids: Optional[torch.Tensor] = None,  # [B, T]: packed documents (equal ids in a run form one)
        cache: Optional[KVCache] = None,
        # 0: every position; k: only the last k (decoding needs 1)
        logits_to_keep: int = 0,
        return_attention: bool = False,
        # with targets and model.mtp: also each MTP depth's loss (GPTOutput.mtp_losses; training objectives)
        mtp: bool = False,
        # with targets: GPTOutput.logps, each target's log-prob under the logits divided by `temperature`,
        # chunked over the tokens (the [B, T, vocab] logits never exist; the preference and policy objectives)
        token_logps: bool = False,
        temperature: float = 1.0,
        # [B] int64 (model.score_head): each row's position whose final hidden state the score head reads
        # (a sequence's last token); GPTOutput.scores [B], no logits
        score_at: Optional[torch.Tensor] = None,
        # f(hidden [B, T, d_model] final-normed, lm_head.weight [V, d_model], model.logit_softcap): a loss
        # that reads the head chunk by chunk (objective=distill), run here, where FSDP2 holds the head's
        # weight gathered, and eagerly under trainer.compile; its result is GPTOutput.head, no logits
        head: Optional[Callable[[torch.Tensor, torch.Tensor, Optional[float]], Any]] = None,
        # [T] or [B, T] int64: the tokens' positions when they are not 0..T-1 (a context-parallel rank's share
        # of each sequence: gptkit/training/context_parallel.py); no cache, no doc_ids with it
        positions: Optional[torch.Tensor] = None,
    ) -> GPTOutput:
        """idx [B, T] (and targets) -> GPTOutput(logits, loss, attentions, aux); see the argument comments.
        loss is the cross-entropy alone: a training loop adds aux.loss (the feed-forwards' auxiliary
        terms)."""
        B, T = idx.shape
        # The positions of the T tokens, one notion through the whole model: an int p (positions p..p+T-1:
        # training, or a KV cache holding p tokens), a [T] tensor (a StaticKVCache: fixed shapes) or a
        # [B, T] tensor (positions restarting at every packed document, model.position_reset).
        given = positions
        positions = cache.positions if cache is not None else 0
        if given is not None:
            if cache is not None or doc_ids is not None:
                raise ValueError("positions= cannot be used with a KV cache or doc_ids")
            positions = given
        if isinstance(positions, int) and positions + T > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {positions + T} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}"
            )
        docs = None
        # attention stays inside each document; positions may restart with each
        if doc_ids is not None:
            if cache is not None or doc_ids.shape != idx.shape:
                raise ValueError(
                    f"doc_ids must be [B, T] = {list(idx.shape)} and cannot be used with a KV cache"
                )
            docs = Documents(doc_ids)
            if self.cfg.position_reset:
                positions = docs.positions  # [B, T]
        x = self.drop(self.embed(idx, positions))
        for rope in (self.rope, self.rope_local):
            if rope is not None:
                rope.forget()
        attentions = [] if return_attention else None
        # the feed-forwards' LayerAux, of the layers that return one
        auxes = []
        for i, block in enumerate(self.blocks):
            x, probs, layer_aux = block(
                x,
                rope=self.rope_of(i),
                cache=cache,
                positions=positions,
                docs=docs,
                return_probs=return_attention,
            )
            if attentions is not None:
                attentions.append(probs)
            if layer_aux is not None:
                auxes.append(layer_aux)
        aux = combine(auxes)
        if cache is not None:
            cache.advance(T)
        x = self.final_norm(x)
        if score_at is not None:
            if self.score is None:
                raise ValueError("score_at needs a score head (model.score_head)")
            h = x[torch.arange(B, device=x.device), score_at.to(x.device)]  # [B, d_model]
            return GPTOutput(None, None, attentions, aux, scores=self.score(h).squeeze(-1).float())
        mtp_losses = None
        if mtp and self.mtp is not None and targets is not None:
            mtp_losses, mtp_auxes = self.mtp(
                x,
                idx,
                targets,
                embed=lambda ids: self.embed(ids, positions),
                lm_head=self.lm_head,
                rope=self.rope_of(self.cfg.n_layers - 1),
                positions=positions,
                docs=docs,
                doc_ids=doc_ids,
            )
            aux = combine(auxes + mtp_auxes)
        softcap = self.cfg.logit_softcap
        if head is not None:
            # under trainer.compile the loss runs eagerly (a graph break: its chunks are data-dependent)
            run = torch.compiler.disable(head) if torch.compiler.is_compiling() else head
            out = run(x, self.lm_head.weight, softcap)
            return GPTOutput(None, None, attentions, aux, mtp_losses, head=out)
        if token_logps:
            if targets is None or logits_to_keep:
                raise ValueError("token_logps needs targets and every position (logits_to_keep=0)")
            logps = fused.linear_log_probs(x, self.lm_head.weight, targets, softcap, temperature)  # [B, T]
            return GPTOutput(None, None, attentions, aux, mtp_losses, logps)
        if targets is not None and not logits_to_keep and "loss" in self.cfg.kernels:
            # lm_head and cross-entropy chunk by chunk: the [B*T, vocab_size] logits never exist
            loss = fused.linear_cross_entropy(x, self.lm_head.weight, targets, softcap)
            return GPTOutput(None, loss, attentions, aux, mtp_losses)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # [B, k, d_model]: project only what is needed
        logits = self.lm_head(x)  # [B, T_kept, vocab_size]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        loss = None
        if targets is not None:
            if logits_to_keep:
                targets = targets[:, -logits_to_keep:]
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)),
                targets.reshape(-1),
                ignore_index=-100,
                # loss in fp32
            )
        return GPTOutput(logits, loss, attentions, aux, mtp_losses)

    def embed(self, idx: torch.Tensor, positions) -> torch.Tensor:
        """idx [B, T] -> the input embeddings [B, T, d_model] at `positions` (an int p: p..p+T-1, or a [T] or
        [B, T] tensor): tok_emb (times sqrt(d_model): scale_embeddings) (+ pos_emb)."""
        x = self.tok_emb(idx)  # [B, T, d_model]
        if self.cfg.scale_embeddings:
            # sqrt(d_model) rounded to the activations' dtype first (as Gemma's reference does)
            x = x * torch.tensor(self.cfg.d_model**0.5).to(x.dtype)
        if self.pos_emb is not None:
            if isinstance(positions, int):
                T = idx.shape[1]
                positions_t = torch.arange(positions, positions + T, device=idx.device)  # [T]
            else:
                positions_t = positions  # [T] or [B, T]
            x = x + self.pos_emb(positions_t)  # [B, T, d_model] ([T, d_model] broadcast)
        return x

    def rope_of(self, layer: int):
        """The RotaryEmbedding layer `layer` rotates with: the local one (model.rope_local_theta) for a local
        layer, else the global one; None for a NoPE layer (model.nope_layers: its q and k are not rotated, nor
        are the keys it caches) or learned positions."""
        if not self.cfg.rotates(layer):
            return None
        return self.rope_local if self.rope_local is not None and self.cfg.window(layer) else self.rope

    @classmethod
    def from_state(
        cls, cfg: ModelConfig, state: dict[str, torch.Tensor], device: str | torch.device = "cpu"
    ) -> "GPT":
        """A GPT (fp32, eval mode, on `device`) holding exactly `state`: built on the meta device, so no
        random init is computed and no second model is made; the tensors are copied in (a bf16/fp16
        state is widened to fp32 without rounding). Names and shapes must match (strict)."""
        with torch.device("meta"):
            model = cls(cfg)
        # RoPE tables are recomputed by RotaryEmbedding._apply
        model = model.to_empty(device=device)
        model.load_state_dict(state, strict=True)
        if cfg.tie_embeddings:
            model.lm_head.weight = model.tok_emb.weight
        return model.eval()

    def rope_restart(self, cached: int, length: int) -> bool:
        """Whether a KV cache filled while the sequence was `cached` tokens long must be filled again, by one
        prefill over the whole sequence, before it serves the sequence at `length` tokens: a longrope
        scaling's switch between short and long factors (RotaryEmbedding.restart). Every decode path asks."""
        return self.rope is not None and self.rope.restart(cached, length)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters of the model (tied embeddings counted once)."""
        # tied weights are counted once
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
        return n


@torch.no_grad()
def grow_vocab(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """`state` with tok_emb (and lm_head) grown to vocab_size rows, each new row the mean of the old rows
    (new tokens, such as a chat template's, start where the model already is: no outlier logits)."""
    out = dict(state)
    for name in ("tok_emb.weight", "lm_head.weight"):
        w = state.get(name)
        if w is None or w.shape[0] >= vocab_size:
            continue
        new = w.float().mean(0, keepdim=True).to(w.dtype).expand(vocab_size - w.shape[0], -1)  # [new, d]
        out[name] = torch.cat([w, new], dim=0)  # [vocab_size, d_model]
    return out
