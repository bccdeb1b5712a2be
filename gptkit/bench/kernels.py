"""`gptkit bench kernels`: the fused kernels (model.kernels) and document masking against eager PyTorch.

Rows print as each measurement finishes (bench.out, JSON, is rewritten after every row):

  loss-memory  (any machine) peak memory of lm_head + cross-entropy, forward and backward, eager
               (F.linear -> .float() -> F.cross_entropy, as GPT.forward without the fused loss) against
               the chunked fused loss, for each of bench.loss_shapes. Memory is the peak of the tensor
               storage alive (allocated inside the measured step: inputs excluded, gradients included),
               tracked op by op (PeakMemory); with fake=true the tensors are fake (no memory is used, so
               8 x 2048 tokens at a 128k vocabulary fit on any machine); fake=false runs real tensors
               and also times them.
  logp-memory  (any machine) the same for the per-token log-probs DPO, KTO and GRPO read, under a DPO
               sigmoid loss (the reference's log-probs given), forward and backward, for each of
               bench.logp_shapes (pairs x 2 rows of T tokens): eager (F.linear -> .float() ->
               F.cross_entropy(reduction="none"), the objectives' unchunked path) against the chunked
               linear_log_probs (GPT.forward(token_logps=True)), whose backward recomputes each chunk.
  distill-memory  (any machine) the same for objective=distill's loss (a student's and a teacher's heads,
               divergence at distill.beta and temperature plus alpha times the labels' CE, every position
               labelled), forward and backward, for each of bench.distill_shapes (rows x T tokens, the
               teacher d_teacher wide): eager (both models' whole logits -> distill_loss, the objective's
               unchunked reference; the teacher's logits without grad) against the chunked linear_distill
               (GPT.forward(head=...)), whose backward recomputes each chunk of both heads; fake=false
               also times them (median of 3: wall and this process's CPU seconds).
  doc-tiles    (any machine) the (query tile, key tile) products the attention forward computes per head
               for documents of mean length bench.doc_lens packed into T = bench.doc_T windows, against
               plain causal attention (flash.forward_tiles: the kernel's own schedule; the tests hold it
               equal to the interpreter's count). On a GPU also the ms of forward+backward: ours (fa2,
               tma) causal and document-masked, and SDPA with the model's dense document mask.
  cpu-linear   (CPU) a decode step's Linear layers at bench.cpu_linear.rows rows a call: F.linear, torch's
               best layout and gptkit's CPU kernel (gptkit_kernels.cpu_linear), and the same weights as
               quantize=int8 on torch's paths and on the kernel, interleaved: ms a step and the speedups
               over torch's (gptkit/bench/cpu_linear.py).
  kernel       (GPU) ms of forward+backward and peak memory, fused against eager: rmsnorm, layernorm,
               swiglu, rope, loss at bench.rows tokens.
  model        (GPU) training tokens/s of bench.model (the Llama 3.2 1B shape) with model.kernels=[] and
               with every fused kernel.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gptkit.conf_tree import conf_dir
from gptkit.model import GPT, ModelConfig
from gptkit.model.attention import sdpa_attention
from gptkit.model.documents import Documents, document_bounds
from gptkit.model.layers import RotaryEmbedding, _rotate

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# of the GPU rows (a dry run on the CPU changes it)
DEVICE = "cuda"


class PeakMemory(TorchDispatchMode):
    """Tracks the tensor storage that ops allocate inside the block: bytes alive now, their peak, and the
    largest single allocation. A storage counts from the op that creates it until it is freed (a weak
    reference on the storage, whose Python object lives exactly as long as the storage itself).
    Storages that existed before the block (inputs, parameters) are not counted. Works for any device,
    fake tensors included."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = self.largest = 0
        self._live: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = {
            t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                # a new storage (not a view, not out=)
                if st._cdata not in seen and st._cdata not in self._live:
                    self._add(st)
        return out

    def _add(self, st) -> None:
        n, key = st.nbytes(), st._cdata

        def freed(_ref, self=self, n=n, key=key):
            self.current -= n
            self._live.pop(key, None)

        self._live[key] = weakref.ref(st, freed)
        self.current += n
        self.peak = max(self.peak, self.current)
        self.largest = max(self.largest, n)


def loss_step(
    fused: bool, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int | None = None
) -> None:
    """Forward and backward of lm_head + cross-entropy: eager (as GPT.forward) or chunked (model.kernels:
    loss)."""
    if fused:
        from gptkit_kernels.linear_ce import linear_cross_entropy

        loss = linear_cross_entropy(x, weight, targets, chunk_size=chunk_size)
    else:
        loss = F.cross_entropy(F.linear(x, weight).float(), targets, ignore_index=-100)
    loss.backward()


def loss_memory(
    tokens: int,
    vocab: int,
    d_model: int,
    dtype: torch.dtype,
    fused: bool,
    fake: bool = True,
    device: str = "cpu",
    chunk_size: int | None = None,
) -> PeakMemory:
    """PeakMemory of one loss_step (inputs made before it; their gradients count)."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        x = torch.randn(tokens, d_model, dtype=dtype, device=device, requires_grad=True)  # [N, d]
        w = torch.randn(vocab, d_model, dtype=dtype, device=device, requires_grad=True)  # [V, d]
        t = torch.randint(0, vocab, (tokens,), device=device)  # [N]
        with PeakMemory() as pm:
            loss_step(fused, x, w, t, chunk_size)
    return pm


def logp_step(chunked: bool, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    """Forward and backward of a DPO sigmoid loss (beta 0.1) on the summed answer log-probs of x's rows
    [2P, T, d] (chosen even, rejected odd), the reference's taken as 0: eager (whole logits) or chunked."""
    if chunked:
        from gptkit_kernels.linear_ce import linear_log_probs

        logps = linear_log_probs(x, weight, targets)  # [2P, T]
    else:
        v = weight.shape[0]
        logits = F.linear(x, weight).float()  # [2P, T, V]
        logps = -F.cross_entropy(
            logits.reshape(-1, v), targets.reshape(-1), ignore_index=-100, reduction="none"
        ).view(targets.shape)
    pairs = logps.sum(-1).view(-1, 2)  # [P, 2]
    (-F.logsigmoid(0.1 * (pairs[:, 0] - pairs[:, 1]))).mean().backward()


def logp_memory(
    pairs: int, T: int, vocab: int, d_model: int, dtype: torch.dtype, chunked: bool, fake: bool = True
) -> PeakMemory:
    """PeakMemory of one logp_step (inputs made before it; their gradients count)."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        x = torch.randn(2 * pairs, T, d_model, dtype=dtype, requires_grad=True)  # [2P, T, d]
        w = torch.randn(vocab, d_model, dtype=dtype, requires_grad=True)  # [V, d]
        t = torch.randint(0, vocab, (2 * pairs, T))  # [2P, T]
        with PeakMemory() as pm:
            logp_step(chunked, x, w, t)
    return pm


def distill_step(
    chunked: bool, x, weight, tx, tweight, targets, beta: float, tau: float, alpha: float
) -> None:
    """Forward and backward of objective=distill's loss of the student's rows x [N, T, d] (head weight)
    against the teacher's tx [N, T, d_t] (tweight, no grad), every position labelled: eager (whole logits,
    distill_loss) or chunked (linear_distill). Fake tensors have no data to pick the label rows by (a
    boolean mask's size is data): both sides are then given them, every position, as the same index_select
    (the copy distill_loss's mask makes)."""
    from gptkit.training.objectives.distill import distill_loss, divergence
    from gptkit_kernels.linear_distill import linear_distill

    fake = isinstance(x, FakeTensor)
    rows = torch.arange(targets.numel()) if fake else None  # [N T]
    if chunked:
        settings = dict(beta=beta, temperature=tau, alpha=alpha, label_rows=rows)
        loss = linear_distill(x, weight, tx, tweight, targets, **settings)[0]
    else:
        with torch.no_grad():
            teacher = F.linear(tx, tweight)  # [N, T, V]
        student = F.linear(x, weight)  # [N, T, V]
        if fake:
            # distill_loss with the mask as an index (every row)
            v = weight.shape[0]
            s, t = student.reshape(-1, v).index_select(0, rows), teacher.reshape(-1, v).index_select(0, rows)
            n = rows.numel()
            d = divergence(s, t, beta, tau).sum() / n
            ce = F.cross_entropy(s.float(), targets.reshape(-1), reduction="sum") / n
            loss = alpha * ce + (1.0 - alpha) * d
        else:
            loss = distill_loss(student, teacher, targets, beta, tau, alpha)[0]
    loss.backward()


def distill_memory(shape, chunked: bool) -> PeakMemory:
    """PeakMemory of one distill_step (inputs made before it; their gradients count) of a
    bench.distill_shapes entry."""
    n, T, vocab, d, dt = (
        int(shape.rows),
        int(shape.T),
        int(shape.vocab),
        int(shape.d_model),
        int(shape.d_teacher),
    )
    dtype = DTYPES[shape.dtype]
    with FakeTensorMode() if shape.fake else contextlib.nullcontext():
        x = torch.randn(n, T, d, dtype=dtype, requires_grad=True)  # [N, T, d]
        w = torch.randn(vocab, d, dtype=dtype, requires_grad=True)  # [V, d]
        tx = torch.randn(n, T, dt, dtype=dtype)  # [N, T, d_t]
        tw = torch.randn(vocab, dt, dtype=dtype)  # [V, d_t]
        t = torch.randint(0, vocab, (n, T))  # [N, T]
        with PeakMemory() as pm:
            distill_step(
                chunked, x, w, tx, tw, t, float(shape.beta), float(shape.temperature), float(shape.alpha)
            )
    return pm


def document_windows(T: int, mean_len: int, n_windows: int, seed: int = 0) -> torch.Tensor:
    """doc_ids [n_windows, T] for documents of geometric lengths with mean `mean_len`, packed back to back."""
    g = torch.Generator().manual_seed(seed)
    ends = torch.rand(n_windows, T, generator=g) < 1.0 / mean_len  # [n, T]: a document ends here
    return (ends.int().cumsum(1) - ends.int()).int()  # [n, T]


def run(cfg) -> int:
    from gptkit.bench.attention import TRITON_MISSING, environment, triton_version

    if cfg.get("cpu_linear"):
        from gptkit.bench import cpu_linear

        cpu_linear.check(cfg.cpu_linear)  # a bad option: its one line before any row
    env = environment()
    gpu = torch.cuda.is_available()
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}", flush=True)
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print("  ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
        if cfg.out:
            import json

            from gptkit.fsio import atomic_write_text

            atomic_write_text(cfg.out, json.dumps({**env, "rows": rows}, indent=2))

    # the chunked loss is pure torch: runs anywhere
    for shape in cfg.loss_shapes:
        _loss_rows(emit, shape)
    for shape in cfg.get("logp_shapes") or []:
        _logp_rows(emit, shape)
    for shape in cfg.get("distill_shapes") or []:
        _distill_rows(emit, shape)
    # gptkit's CPU decode linear against torch's layouts (needs a C compiler and AVX-512, not Triton)
    if cfg.get("cpu_linear"):
        cpu_linear.rows(emit, cfg.cpu_linear)
    # the tile schedule and the fused kernels are Triton's
    if triton_version() is None:
        emit({"what": "doc-tiles, kernel, model", "note": f"not measured: {TRITON_MISSING}"})
        return _wrote(cfg)
    _doc_rows(emit, cfg, gpu)
    if gpu:
        _kernel_rows(emit, cfg)
        _model_rows(emit, cfg)
    else:
        emit({"what": "kernel, model", "note": "not measured: needs a CUDA GPU"})
    return _wrote(cfg)


def _wrote(cfg) -> int:
    if cfg.out:
        print(f"wrote {cfg.out}", flush=True)
    return 0


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _loss_rows(emit, shape) -> None:
    from gptkit_kernels.linear_ce import chunk_rows

    tokens, vocab, d, dtype, fake = (
        int(shape.tokens),
        int(shape.vocab),
        int(shape.d_model),
        DTYPES[shape.dtype],
        bool(shape.fake),
    )
    chunk = shape.get("chunk_size")
    row = {
        "what": "loss-memory",
        "tokens": tokens,
        "vocab": vocab,
        "d_model": d,
        "dtype": shape.dtype,
        "tensors": "fake" if fake else "real",
        "chunk_rows": chunk_rows(tokens, vocab, chunk),
    }
    for name, fused in (("eager", False), ("fused", True)):
        pm = loss_memory(tokens, vocab, d, dtype, fused, fake, chunk_size=chunk)
        # the median of 3 timed runs after this warm-up
        if not fake:
            times = []
            for _ in range(3):
                start = time.perf_counter()
                loss_memory(tokens, vocab, d, dtype, fused, fake, chunk_size=chunk)
                times.append(time.perf_counter() - start)
            row[f"{name}_s"] = sorted(times)[1]
        row[f"{name}_peak_MB"] = pm.peak / 2**20
        row[f"{name}_largest_MB"] = pm.largest / 2**20
    row["peak_ratio"] = row["eager_peak_MB"] / row["fused_peak_MB"]
    emit(row)


def _logp_rows(emit, shape) -> None:
    from gptkit_kernels.linear_ce import chunk_rows

    pairs, T, vocab, d = int(shape.pairs), int(shape.T), int(shape.vocab), int(shape.d_model)
    dtype, fake = DTYPES[shape.dtype], bool(shape.fake)
    row = {
        "what": "logp-memory",
        "pairs": pairs,
        "T": T,
        "vocab": vocab,
        "d_model": d,
        "dtype": shape.dtype,
        "tensors": "fake" if fake else "real",
        "chunk_rows": chunk_rows(2 * pairs * T, vocab),
    }
    for name, chunked in (("eager", False), ("chunked", True)):
        pm = logp_memory(pairs, T, vocab, d, dtype, chunked, fake)
        if not fake:
            # the median of 3 timed runs after this one
            times = []
            for _ in range(3):
                start = time.perf_counter()
                logp_memory(pairs, T, vocab, d, dtype, chunked, fake)
                times.append(time.perf_counter() - start)
            row[f"{name}_s"] = sorted(times)[1]
        row[f"{name}_peak_MB"] = pm.peak / 2**20
        row[f"{name}_largest_MB"] = pm.largest / 2**20
    row["peak_ratio"] = row["eager_peak_MB"] / row["chunked_peak_MB"]
    emit(row)


def _distill_rows(emit, shape) -> None:
    from gptkit_kernels.linear_ce import chunk_rows
    from gptkit_kernels.linear_distill import CHUNK_TENSORS

    tokens, vocab = int(shape.rows) * int(shape.T), int(shape.vocab)
    row = {
        "what": "distill-memory",
        "rows": int(shape.rows),
        "T": int(shape.T),
        "vocab": vocab,
        "d_model": int(shape.d_model),
        "d_teacher": int(shape.d_teacher),
        "dtype": shape.dtype,
        "beta": float(shape.beta),
        "temperature": float(shape.temperature),
        "alpha": float(shape.alpha),
        "tensors": "fake" if shape.fake else "real",
        "chunk_rows": max(1, chunk_rows(tokens, vocab) // CHUNK_TENSORS),
    }
    for name, chunked in (("eager", False), ("chunked", True)):
        pm = distill_memory(shape, chunked)
        if not shape.fake:
            # the median of 3 timed runs after this one: wall clock, and this process's CPU time (the figure
            # that holds on a shared machine)
            times, cpu = [], []
            for _ in range(3):
                start, start_cpu = time.perf_counter(), time.process_time()
                distill_memory(shape, chunked)
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            row[f"{name}_s"], row[f"{name}_cpu_s"] = sorted(times)[1], sorted(cpu)[1]
        row[f"{name}_peak_MB"] = pm.peak / 2**20
        row[f"{name}_largest_MB"] = pm.largest / 2**20
    row["peak_ratio"] = row["eager_peak_MB"] / row["chunked_peak_MB"]
    emit(row)


def _doc_rows(emit, cfg, gpu: bool) -> None:
    from gptkit_kernels.flash import forward_tiles

    T, (bm, bn) = int(cfg.doc_T), cfg.doc_blocks
    causal = forward_tiles(T, bm, bn, True)
    for mean_len in cfg.doc_lens:
        ids = document_windows(T, int(mean_len), int(cfg.doc_windows))  # [n, T]
        bounds = document_bounds(ids)
        tiles = forward_tiles(T, bm, bn, True, bounds) / len(ids)
        row = {
            "what": "doc-tiles",
            "T": T,
            "mean_doc_len": int(mean_len),
            "blocks": f"{bm}x{bn}",
            "tiles_per_head": tiles,
            "causal_tiles_per_head": causal,
            "fraction": tiles / causal,
        }
        if gpu:
            row.update(_doc_times(cfg, ids))
        else:
            row["gpu_ms"] = "not measured on a GPU"
        emit(row)


def _doc_times(cfg, ids) -> dict:
    """GPU ms of attention forward+backward on these windows: ours (fa2, tma) plain causal and
    document-masked,
    and SDPA with the dense document mask (the model's sdpa fallback)."""
    from triton.testing import do_bench

    from gptkit_kernels import flash_attention

    n, T = ids.shape
    H, D = int(cfg.doc_heads), int(cfg.doc_head_dim)
    q, k, v = (
        torch.randn(n, H, T, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    docs = Documents(ids.to(DEVICE))
    bounds = (docs.start, docs.end)
    runs = {
        f"{impl}_{name}": (lambda impl=impl, kw=kw: flash_attention(q, k, v, causal=True, impl=impl, **kw))
        for impl in ("fa2", "tma")
        for name, kw in (("causal", {}), ("docs", {"doc_bounds": bounds}))
    }
    runs["sdpa_dense_mask_docs"] = lambda: sdpa_attention(q, k, v, causal=True, docs=docs)[0]
    out = {}
    for name, fn in runs.items():

        def step(fn=fn):
            torch.autograd.grad(fn(), (q, k, v), torch.ones_like(q))

        try:
            out[f"{name}_fwd_bwd_ms"] = do_bench(
                step, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median"
            )
        except torch.cuda.OutOfMemoryError:
            out[f"{name}_fwd_bwd_ms"] = "oom"
        torch.cuda.empty_cache()
    return out


def _kernel_rows(emit, cfg) -> None:
    from triton.testing import do_bench

    from gptkit_kernels.linear_ce import linear_cross_entropy
    from gptkit_kernels.norm import layer_norm, rms_norm
    from gptkit_kernels.rope import rope
    from gptkit_kernels.swiglu import swiglu

    N, d, f, V = int(cfg.rows), int(cfg.d_model), int(cfg.d_ff), int(cfg.vocab)
    H, Hkv, D = int(cfg.n_heads), int(cfg.n_kv_heads), d // int(cfg.n_heads)
    dt = DTYPES[cfg.dtype]

    def t(*shape, grad=True):
        return torch.randn(*shape, device=DEVICE, dtype=dt, requires_grad=grad)

    x, w, b = t(N, d), t(d), t(d)
    g, u = t(N, f), t(N, f)
    rot = RotaryEmbedding(D, 8192, 10000.0).to(DEVICE)
    T = 2048
    q, k = t(N // T, H, T, D), t(N // T, Hkv, T, D)
    wv, tg = t(V, d), torch.randint(0, V, (N,), device=DEVICE)
    cases = {
        "rmsnorm": (
            (x, w),
            lambda x, w: (
                w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
            ),
            lambda x, w: rms_norm(x, w, 1e-5),
        ),
        "layernorm": (
            (x, w, b),
            lambda x, w, b: F.layer_norm(x.float(), (d,), w.float(), b.float(), 1e-5).to(x.dtype),
            lambda x, w, b: layer_norm(x, w, b, 1e-5),
        ),
        "swiglu": ((g, u), lambda g, u: F.silu(g) * u, swiglu),
        "rope": (
            (q, k),
            lambda q, k: (_rotate(q, rot.cos[:T], rot.sin[:T]), _rotate(k, rot.cos[:T], rot.sin[:T])),
            lambda q, k: rope(q, k, rot.cos, rot.sin),
        ),
        "loss": (
            (x, wv),
            lambda x, w: F.cross_entropy(F.linear(x, w).float(), tg),
            lambda x, w: linear_cross_entropy(x, w, tg),
        ),
    }
    for name, (inputs, eager, fused) in cases.items():
        row = {"what": "kernel", "kernel": name, "rows": N, "dtype": cfg.dtype}
        for impl, fn in (("eager", eager), ("fused", fused)):

            def step(fn=fn):
                for p in inputs:
                    p.grad = None
                out = fn(*inputs)
                outs = out if isinstance(out, tuple) else (out,)
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            row[f"{impl}_peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            row[f"{impl}_ms"] = do_bench(step, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")
        row["speedup"] = row["eager_ms"] / row["fused_ms"]
        emit(row)


def _model_rows(emit, cfg) -> None:
    base = OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / f"{cfg.model}.yaml"))
    base.update(OmegaConf.to_container(cfg.model_overrides))
    B, T = int(cfg.model_batch), int(base["max_seq_len"])
    for kernels in ([], ["norm", "swiglu", "rope", "loss"]):
        mc = ModelConfig.from_dict({**base, "kernels": kernels})
        torch.manual_seed(0)
        model = GPT(mc).to(DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE == "cuda")
        idx = torch.randint(0, mc.vocab_size, (B, T), device=DEVICE)
        torch.cuda.reset_peak_memory_stats()

        def step():
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = model(idx, idx).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(int(cfg.model_warmup)):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(int(cfg.model_steps)):
            step()
        torch.cuda.synchronize()
        sec = (time.perf_counter() - start) / int(cfg.model_steps)
        emit(
            {
                "what": "model",
                "model": f"{cfg.model} {dict(cfg.model_overrides)}",
                "attention": mc.attention,
                "kernels": kernels or "[] (eager)",
                "batch": f"{B}x{T}",
                "tokens_per_s": B * T / sec,
                "peak_GB": torch.cuda.max_memory_allocated() / 2**30,
            }
        )
        # free this model before the next one
        model = opt = None
        torch.cuda.empty_cache()
