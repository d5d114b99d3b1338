"""Measure this host for the HRM: PCIe copies, GEMM, HBM and host bandwidth, CPU decode attention.

``profile_host`` returns a HardwareProfile whose CPU side is measured here and whose GPU side is
measured when CUDA is available, else taken from a preset (and said so). ``moe-batch profile`` writes it
as YAML with the date and a host description. Conventions: a copy's bandwidth counts the bytes moved
once (pinned h2d/d2h: bytes / time); memory-to-memory copies (HBM, host DRAM) count bytes read +
written, like STREAM's "copy" (2 * bytes / time). CPU attention throughput is the KV bytes the project's
own routine streams per second (K and V of every attended position, measured as the executor runs it:
:func:`measure_cpu_attention_executor`) and its FLOP/s.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch

from ..policy.hardware import GENERIC_HOST_PROBE, MLA_HOST_PROBE, GiB, MiB, HardwareProfile, get_preset


def _best_time(fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """Minimum wall time of ``fn`` over ``repeats`` runs after one warm-up (seconds)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_host_bandwidth(nbytes: int = 512 * MiB, repeats: int = 3) -> float:
    """Host DRAM copy bandwidth in bytes/s: 2 * nbytes / time of ``dst.copy_(src)`` (read + write)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src), repeats)


def _reference_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Torch stand-in for pipeline.cpu_attention.cpu_decode_attention (same shapes): q [B,Hq,hd], k/v [B,Hkv,S,hd]."""
    B, Hq, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.view(B, Hkv, Hq // Hkv, hd).float()
    scores = torch.einsum("bgqd,bgsd->bgqs", qg, k.float()) / hd**0.5
    mask = torch.arange(S)[None, :] >= lengths[:, None]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bgqs,bgsd->bgqd", scores.softmax(-1), v.float())
    return out.reshape(B, Hq * hd).to(q.dtype)


def _matmul_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Unfused decode attention in the cache dtype (two batched matmuls, fp32 softmax): the alternative to the
    fused SDPA call that ``moe-batch profile`` times beside it. q [B,Hq,hd], k/v [B,Hkv,S,hd] -> [B, Hq*hd]."""
    B, Hq, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.view(B, Hkv, Hq // Hkv, hd)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * hd**-0.5  # [B, Hkv, G, S]
    mask = torch.arange(S)[None, :] >= lengths[:, None]
    probs = scores.masked_fill(mask[:, None, None, :], float("-inf")).softmax(-1).to(q.dtype)
    return torch.matmul(probs, v).reshape(B, Hq * hd)


def measure_cpu_attention(batch: int = 32, q_heads: int = 32, kv_heads: int = 8, seq: int = 1024, head_dim: int = 128,
                          dtype: torch.dtype = torch.bfloat16, repeats: int = 3) -> tuple[float, float, str]:
    """CPU decode attention throughput: (KV bytes/s, FLOP/s, which routine ran).

    Runs ``lightning_moe.pipeline.cpu_attention.cpu_decode_attention(q, k, v, lengths)`` (imported lazily)
    on q [B, Hq, hd], k/v [B, Hkv, S, hd] with every row at full length S; falls back to an equivalent torch
    computation if that module is missing. Bytes = 2 B Hkv S hd itemsize (K and V);
    FLOPs = B S 4 Hq hd (QK^T and PV).
    """
    try:
        from .cpu_attention import cpu_decode_attention as fn

        from ..kernels.cpu_attention import native_available

        which = "lightning_moe.pipeline.cpu_attention.cpu_decode_attention (" + (
            "native kernel" if native_available() else "torch scaled_dot_product_attention") + ")"
    except ImportError:
        fn = _reference_decode_attention
        which = "torch reference (lightning_moe.pipeline.cpu_attention not available)"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(dtype)
    lengths = torch.full((batch,), seq, dtype=torch.int64)
    t = _best_time(lambda: fn(q, k, v, lengths), repeats)
    nbytes = 2 * batch * kv_heads * seq * head_dim * k.element_size()
    flops = batch * seq * 4 * q_heads * head_dim
    return nbytes / t, flops / t, which


def measure_cpu_latent_attention(rows: int = 256, heads: int = 16, kv_lora_rank: int = 512, rope_dim: int = 64,
                                 seq: int = 256, repeats: int = 3) -> float:
    """FLOP/s of the native MLA decode-attention kernel (:func:`~..kernels.cpu_latent_attention.latent_attention_append`,
    no append) on a compute-bound shape: ``rows`` rows x ``seq`` cached latents [kv_lora_rank + rope_dim] (bf16),
    ``heads`` query heads sharing each row (DeepSeek-V2-Lite's widths by default); FLOPs = rows seq heads
    (2 (Dl + rd) + 2 Dl) (scores and values), as MoESpec.attn_flops_per_position counts them. 0.0 without the
    native kernel (the profile's field then stays unmeasured)."""
    from ..kernels.cpu_attention import native_available
    from ..kernels.cpu_latent_attention import latent_attention_append

    if not native_available():
        return 0.0
    E = kv_lora_rank + rope_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, E, generator=g).to(torch.bfloat16)
    cache = torch.randn(rows, seq, E, generator=g).to(torch.bfloat16)
    lengths = torch.full((rows,), seq, dtype=torch.int64)
    out = torch.empty(rows, heads, kv_lora_rank, dtype=torch.bfloat16)
    idx = torch.arange(rows)
    t = _best_time(lambda: latent_attention_append(q, None, None, idx, cache, lengths, out, E ** -0.5), repeats)
    return rows * seq * heads * (2 * E + 2 * kv_lora_rank) / t


def measure_cpu_attention_executor(rows: int = 512, mean_len: int = 128, gen: int = 64, layers: int = 4,
                                   repeats: int = 3, lengths: Optional[Sequence[int]] = None,
                                   worker: bool = True) -> float:
    """CPU decode attention as CGOPipe runs it, in bytes/s of VALID KV (K and V of every attended position).

    Executor conditions the plain probe (:func:`measure_cpu_attention`: one call, equal full-length rows,
    contiguous cache, main thread) lacks: ``rows`` sequences of spread lengths (a deterministic geometric ramp
    from ~0.3x to ~3.3x ``mean_len``, like real prompts; or the given ``lengths``, positions already cached), a
    ``pipeline.kv_cache.GroupedKVCache`` sized for length + ``gen`` (at most 8 length groups, strided views,
    each group's padding read by the torch fallback only), the new token's k/v appended, one call per group
    (``GroupedKVCache.append_attend``: the native kernel, else append + ``cpu_decode_attention``), on a
    one-thread ``ThreadPoolExecutor`` like CGOPipe's worker (``worker=False``: on the calling thread), the
    output written into pinned memory when CUDA is present (as the executor does), over ``layers`` layers' caches
    (Mixtral-8x7B attention shape: 32 query / 8 KV heads, head dim 128, bf16). The HRM divides valid KV bytes
    by this rate ((H5) in policy/hrm.py), so grouping padding and these overheads are in it.
    Seconds per layer = best of ``repeats`` passes over the layers / layers.
    """
    from concurrent.futures import ThreadPoolExecutor

    layer, valid = executor_attention_layer(rows, mean_len, gen, layers, lengths)
    with ThreadPoolExecutor(max_workers=1) as pool:
        run = (lambda l: pool.submit(layer, l).result()) if worker else layer
        t = _best_time(lambda: [run(l) for l in range(layers)], repeats) / layers
    return valid / t


def executor_attention_layer(rows: int = 512, mean_len: int = 128, gen: int = 64, layers: int = 4,
                             lengths: Optional[Sequence[int]] = None) -> tuple[Callable[[int], torch.Tensor], int]:
    """(``layer(l)``, valid KV bytes of one layer): one layer's CPU decode attention as CGOPipe runs it, over the
    grouped KV cache :func:`measure_cpu_attention_executor` describes (``lengths``, else ``rows`` lengths around
    ``mean_len``; caches sized for ``gen`` more positions; ``layers`` layers' caches, Mixtral-8x7B's attention shape,
    bf16); ``layer(l)`` appends the new token's k/v to layer ``l`` and attends (pinned output where CUDA is present)."""
    from .kv_cache import GroupedKVCache
    from ..policy.registry import resolve_spec

    spec = resolve_spec("mixtral-8x7b").with_layers(layers)
    Hq, Hkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if lengths is None:
        ramp = torch.exp(torch.linspace(-1.2, 1.2, rows))  # spread of lengths, ratio ~11 between extremes
        lens = (ramp / ramp.mean() * mean_len).round().clamp(min=1).long()  # [rows] positions already cached
    else:
        lens = torch.tensor(list(lengths), dtype=torch.int64)
        rows = len(lens)
    kv = GroupedKVCache(spec, (lens + gen).tolist(), torch.bfloat16)
    kv.lengths = lens.clone()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, Hq, hd, generator=g).to(torch.bfloat16)  # [rows, Hq, hd]
    k = torch.randn(rows, Hkv, hd, generator=g).to(torch.bfloat16)  # [rows, Hkv, hd]
    pin = torch.cuda.is_available()

    def layer(l: int) -> torch.Tensor:
        with torch.inference_mode():  # as CGOPipe._cpu_attention: pinned output, append + attend per group
            out = torch.empty((rows, Hq * hd), dtype=torch.bfloat16, pin_memory=pin)
            return kv.append_attend(l, q, k, k, out)

    return layer, int((lens + 1).sum()) * 2 * Hkv * hd * 2


def _time_attention(fn: Callable, batch: int, seq: int, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                    dtype: torch.dtype = torch.bfloat16, repeats: int = 3) -> float:
    """KV bytes/s of a decode attention routine ``fn(q, k, v, lengths)`` at full-length rows (bf16)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(dtype)
    lengths = torch.full((batch,), seq, dtype=torch.int64)
    return 2 * batch * kv_heads * seq * head_dim * k.element_size() / _best_time(lambda: fn(q, k, v, lengths), repeats)


def measure_gpu(copy_bytes: int = 1 * GiB, gemm: int = 8192, repeats: int = 5) -> dict:
    """GPU side (CUDA required): pinned h2d and d2h bytes/s, bf16/fp16/fp32 GEMM FLOP/s, HBM copy bytes/s, memory, name."""
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    gbuf = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    out = {
        "pcie_h2d": copy_bytes / _best_time(lambda: gbuf.copy_(host, non_blocking=True), repeats, sync),
        "pcie_d2h": copy_bytes / _best_time(lambda: host.copy_(gbuf, non_blocking=True), repeats, sync),
    }
    g2 = torch.empty_like(gbuf)
    out["gpu_hbm_bandwidth"] = 2 * copy_bytes / _best_time(lambda: g2.copy_(gbuf), repeats, sync)
    host = gbuf = g2 = None  # free before the GEMMs (the timed lambdas above are done with them)
    for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        a = torch.randn(gemm, gemm, device=dev).to(dt)
        b = torch.randn(gemm, gemm, device=dev).to(dt)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            out[f"gpu_flops_{name}"] = 2 * gemm**3 / _best_time(lambda: a @ b, repeats, sync)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        a = b = None
    props = torch.cuda.get_device_properties(dev)
    out["gpu_memory"] = int(props.total_memory)
    out["gpu_name"] = props.name
    return out


def measure_microbatch_overhead(repeats: int = 30) -> float:
    """Seconds the host needs to issue one micro-batch's work of one layer (CUDA required).

    Runs the executor's own layer pieces (the Mixtral family's pre_attention + post_attention with the Triton
    grouped expert kernel when available, else the torch reference) for a tiny layer (D=256, 8 experts,
    4 tokens), where the GPU work is negligible, and times ``repeats`` calls back to back.
    """
    from ..model.families import family_of
    from ..model.spec import MoESpec
    from ..model.weights import dummy_weights

    spec = MoESpec(name="probe", model_type="mixtral", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=64, num_experts=8, top_k=2, rope_theta=1e4, rms_norm_eps=1e-5,
                   max_position_embeddings=256)
    w = dummy_weights(spec, torch.bfloat16)
    fam = family_of(spec)
    dev = torch.device("cuda")
    lw, ew = w.layers[0].to(dev), w.experts[0].to(dev)
    inv = fam.rope_inv_freq(spec, dev)
    x = torch.randn(4, spec.hidden_size, device=dev, dtype=torch.bfloat16)
    pos = torch.arange(4, device=dev)
    try:
        from ..kernels.fused_moe import fused_experts_triton, triton_available

        ffn = (lambda h, e, tw, ids: fused_experts_triton(h, e.w1, e.w3, e.w2, tw, ids, validate=False)) if triton_available() else fam.experts_ffn
    except ImportError:
        ffn = fam.experts_ffn

    def step():
        q, k, v = fam.pre_attention(lw, x, pos, spec, inv)
        return fam.post_attention(lw, ew, x, q.reshape(4, -1), spec, ffn)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def measure_expert_kernel_flops(tokens: int = 4096, hidden: int = 4096, intermediate: int = 14336, experts: int = 8,
                                top_k: int = 2, repeats: int = 5, seed: int = 0) -> float:
    """FLOP/s of CGOPipe's grouped expert kernel (kernels.fused_moe.fused_experts_triton, the whole call: token
    alignment, gate/up and down GEMMs, slot sum) at a prefill size: ``tokens`` tokens routed top-``top_k`` over
    ``experts`` experts of a Mixtral-8x7B-shaped layer (D = ``hidden``, F = ``intermediate``), bf16 (fp16 where the
    GPU has no bf16). FLOPs 2 T k 3 D F per call; the best of ``repeats`` timed calls after a warm-up. The profile's
    ``gpu_expert_flops`` ((H1)'s routed-expert term in hrm.py caps the GEMM peak with it).

    Why: the grouped kernel runs well below the cuBLAS GEMM peak at prefill shapes, so an HRM that assumed the peak
    over-predicts prefill.

    Raises:
        RuntimeError: no CUDA device, or triton missing.
        ValueError: a size < 1, or top_k > experts.
    """
    from ..kernels.fused_moe import fused_experts_triton, triton_available

    if min(tokens, hidden, intermediate, experts, top_k, repeats) < 1 or top_k > experts:
        raise ValueError(f"measure_expert_kernel_flops: sizes must be >= 1 and top_k <= experts, got tokens={tokens}, "
                         f"hidden={hidden}, intermediate={intermediate}, experts={experts}, top_k={top_k}, repeats={repeats}")
    if not torch.cuda.is_available() or not triton_available():
        raise RuntimeError("measure_expert_kernel_flops: needs a CUDA device and triton")
    dev = torch.device("cuda")
    dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=dev, dtype=dt, generator=g)  # [T, D]
    w1 = torch.randn(experts, intermediate, hidden, device=dev, dtype=dt, generator=g) * 0.02  # [E, F, D]
    w3 = torch.randn(experts, intermediate, hidden, device=dev, dtype=dt, generator=g) * 0.02  # [E, F, D]
    w2 = torch.randn(experts, hidden, intermediate, device=dev, dtype=dt, generator=g) * 0.02  # [E, D, F]
    logits = torch.randn(tokens, experts, device=dev, generator=g)  # [T, E] random router: balanced experts
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)  # [T, k] fp32, int64
    seconds = _best_time(lambda: fused_experts_triton(x, w1, w3, w2, weights, ids, validate=False), repeats,
                         torch.cuda.synchronize)
    x = w1 = w3 = w2 = None
    torch.cuda.empty_cache()
    return 2 * tokens * top_k * 3 * hidden * intermediate / seconds


EXPERT_FFN_SHAPES = ("mixtral-8x7b",)  # registry models whose expert shape `moe-batch profile` rates by default
EXPERT_FFN_TOKENS = (16, 64, 256, 1024, 4096, 8192, 16384, 32768)  # tokens-per-call buckets: decode micro-batches to prefill chunks


def measure_expert_ffn_rates(shapes: Sequence[tuple] = ((4096, 14336, 8, 2),), tokens: Sequence[int] = EXPERT_FFN_TOKENS,
                             dtype: Optional[torch.dtype] = None, device: str = "cuda", repeats: int = 5,
                             seed: int = 0, log: Callable[[str], None] = lambda _: None) -> tuple:
    """The profile's ``expert_ffn_rates``: FLOP/s of each grouped expert-FFN kernel CGOPipe can run
    (kernels.fused_moe.fused_experts_triton, fused_experts_grouped_mm and fused_experts_mm_loop, the whole call: token
    sort, gate/up and down GEMMs, slot sum; mm_loop with its host sync) per expert shape ``(hidden, intermediate, experts, top_k)`` and per tokens-per-call bucket
    T in ``tokens``, uniformly random top-k routing, in ``dtype`` (default bf16, fp16 where the GPU has no bf16;
    fp32 on the CPU). FLOPs 2 T k 3 D F per call; the best of ``repeats`` timed calls after a warm-up. A kernel that
    fails, or cannot run here (Triton off CUDA without its interpreter; grouped_mm where torch has none or the
    operands do not suit it), gets rate 0 for that entry and a log line; the other kernels' rates stand.

    Returns a tuple of :class:`~lightning_moe.policy.hardware.ExpertFFNRate`.

    Raises:
        ValueError: a size < 1, top_k > experts, or an empty ``shapes`` / ``tokens``.
    """
    from ..kernels.fused_moe import (_interpret_mode, fused_experts_grouped_mm, fused_experts_mm_loop,
                                     fused_experts_triton, grouped_mm_unsupported, triton_available)
    from ..policy.hardware import ExpertFFNRate

    if not shapes or not tokens or repeats < 1 or min(tokens) < 1:
        raise ValueError(f"measure_expert_ffn_rates: need shapes, tokens >= 1 and repeats >= 1, got shapes={shapes}, "
                         f"tokens={tokens}, repeats={repeats}")
    for D, Fd, E, k in shapes:
        if min(D, Fd, E, k) < 1 or k > E:
            raise ValueError(f"measure_expert_ffn_rates: bad shape (hidden={D}, intermediate={Fd}, experts={E}, "
                             f"top_k={k}): sizes >= 1 and top_k <= experts")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if dtype is None:
        dtype = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    triton_ok = triton_available() and (cuda or _interpret_mode())
    out = []
    for D, Fd, E, k in shapes:
        g = torch.Generator(device=dev).manual_seed(seed)
        w1 = (torch.randn(E, Fd, D, device=dev, generator=g) * 0.02).to(dtype)  # [E, F, D]
        w3 = (torch.randn(E, Fd, D, device=dev, generator=g) * 0.02).to(dtype)  # [E, F, D]
        w2 = (torch.randn(E, D, Fd, device=dev, generator=g) * 0.02).to(dtype)  # [E, D, F]
        for T in tokens:
            x = torch.randn(T, D, device=dev, generator=g).to(dtype)  # [T, D]
            logits = torch.randn(T, E, device=dev, generator=g)  # [T, E] random router: balanced experts
            wts, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)  # [T, k] fp32, int64
            rates = {}
            kernels = {"triton": fused_experts_triton if triton_ok else None,
                       "grouped_mm": fused_experts_grouped_mm if grouped_mm_unsupported(x, w1, w3, w2) is None else None,
                       "mm_loop": fused_experts_mm_loop}
            for kname, fn in kernels.items():
                if fn is None:
                    rates[kname] = 0.0
                    continue
                try:
                    sec = _best_time(lambda: fn(x, w1, w3, w2, wts, ids, validate=False), repeats, sync)
                except Exception as e:  # noqa: BLE001 - the other kernels' rates stand
                    log(f"  expert FFN {kname} at D={D} F={Fd} E={E} k={k} T={T} failed ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:160] if str(e) else ''}); rate 0")
                    rates[kname] = 0.0
                else:
                    rates[kname] = 2 * T * k * 3 * D * Fd / sec
            out.append(ExpertFFNRate(D, Fd, E, k, name, int(T), **rates))
            log(f"  expert FFN D={D} F={Fd} E={E} top-{k} {name}, T={T}: " + ", ".join(
                f"{kn} {rates[kn] / 1e12:.1f}" for kn in kernels) + f" TFLOP/s -> {out[-1].best}")
        w1 = w3 = w2 = None
        if cuda:
            torch.cuda.empty_cache()
    return tuple(out)


def measure_mxfp4_ffn_rates(shapes: Sequence[tuple], tokens: Sequence[int] = EXPERT_FFN_TOKENS, device: str = "cuda",
                            repeats: int = 5, seed: int = 0, log: Callable[[str], None] = lambda _: None,
                            dtype: torch.dtype = torch.bfloat16) -> tuple:
    """The profile's ``expert_ffn_rates`` entries of MXFP4 expert pages (``weights: mxfp4``): FLOP/s (2 T k 3 D F per
    call) of kernels.mxfp4.fused_experts_mxfp4_triton, the kernel CGOPipe runs over them, per expert shape ``(hidden,
    intermediate, experts, top_k)`` and tokens-per-call bucket, activations and biases in ``dtype`` (the compute
    dtype; ``moe-batch profile``: bf16), uniformly random top-k routing,
    random pages (E2M1 bytes, E8M0 scales 118..126: the rate does not depend on the values); the best of
    ``repeats`` timed calls after a warm-up. A failing call is logged and gets rate 0 (no measurement)."""
    from ..kernels import mxfp4
    from ..policy.hardware import ExpertFFNRate

    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = []
    for D, Fd, E, k in shapes:
        g = torch.Generator(device=dev).manual_seed(seed)

        def codes(R, C, lo=0, hi=256, last=(16,)):
            return torch.randint(lo, hi, (E, R, C // 32, *last), device=dev, generator=g, dtype=torch.uint8)

        bias = [torch.randn(E, n, device=dev, generator=g).to(dtype) for n in (2 * Fd, D)]
        pages, lay = mxfp4.pack_mxfp4_pages(codes(2 * Fd, D), codes(2 * Fd, D, 118, 127, ()), bias[0],
                                            codes(D, Fd), codes(D, Fd, 118, 127, ()), bias[1])
        for T in tokens:
            x = torch.randn(T, D, device=dev, generator=g).to(dtype)  # [T, D]
            wts, ids = torch.topk(torch.softmax(torch.randn(T, E, device=dev, generator=g), -1), k, dim=-1)
            try:
                sec = _best_time(lambda: mxfp4.fused_experts_mxfp4_triton(x, pages, lay, wts, ids, limit=7.0,
                                                                          alpha=1.702, validate=False), repeats, sync)
                rate = 2 * T * k * 3 * D * Fd / sec
            except Exception as e:  # noqa: BLE001 - the other entries stand
                log(f"  MXFP4 expert FFN at D={D} F={Fd} E={E} k={k} T={T} failed ({_failure(e)}); rate 0")
                rate = 0.0
            out.append(ExpertFFNRate(D, Fd, E, k, name, int(T), triton=rate, weights="mxfp4"))
            log(f"  expert FFN D={D} F={Fd} E={E} top-{k} MXFP4 pages, {name}, T={T}: {rate / 1e12:.1f} TFLOP/s")
        pages = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return tuple(out)


def measure_shape_expert_ffn_rates(shape: tuple, dtype: str, weights: str = "dense", device: str = "cuda",
                                   log: Callable[[str], None] = lambda _: None) -> tuple:
    """The ``expert_ffn_rates`` entries of one expert shape ``(hidden, intermediate, experts, top_k)`` in ``dtype``
    ("bf16" | "fp16" | "fp32"), measured as ``moe-batch profile`` measures a shape (the same probes, EXPERT_FFN_TOKENS
    buckets and repeats): the dense kernels' (:func:`measure_expert_ffn_rates`), or for ``weights`` "mxfp4" the MXFP4
    kernel's over packed pages (:func:`measure_mxfp4_ffn_rates`). On CUDA, ``device`` (e.g. "cuda:1") is the current
    device while they run (Triton launches on the current one) and the probes' memory is released after.

    Raises what the probes raise (e.g. torch.OutOfMemoryError where the shape's weights do not fit the card).
    """
    import contextlib

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    try:
        with torch.cuda.device(torch.device(device)) if cuda else contextlib.nullcontext():
            if weights == "mxfp4":
                return measure_mxfp4_ffn_rates([shape], EXPERT_FFN_TOKENS, device=device, log=log, dtype=dt)
            return measure_expert_ffn_rates([shape], EXPERT_FFN_TOKENS, dtype=dt, device=device, log=log)
    finally:
        if cuda:
            torch.cuda.empty_cache()


def mxfp4_shapes_of(names: Sequence[str]) -> tuple:
    """``(hidden, intermediate, experts, top_k)`` of those models whose experts are MXFP4 (a registry name of a Hub
    checkpoint that holds them, ``policy.registry.registry_expert_format``; a checkpoint directory with
    ``quant_method: mxfp4``, ``model.quantized.checkpoint_expert_scheme``)."""
    from ..model.quantized import checkpoint_expert_scheme
    from ..policy.registry import registry_expert_format

    mx = [n for n in names if (checkpoint_expert_scheme(n) if os.path.isdir(n) else registry_expert_format(n)) == "mxfp4"]
    return expert_shapes_of(mx)


def expert_shapes_of(names: Sequence[str]) -> tuple:
    """``(hidden, intermediate, experts, top_k)`` of registry models (``policy.registry.resolve_spec``: a name or a
    checkpoint directory). Raises ValueError on an unknown name."""
    from ..policy.registry import resolve_spec

    out = []
    for n in names:
        s = resolve_spec(n)
        shape = (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k)
        if shape not in out:
            out.append(shape)
    return tuple(out)


def measure_host_issue(device: str = "cuda", layers: int = 8, mu: int = 64, steps: int = 8,
                       probe: str = GENERIC_HOST_PROBE) -> tuple[float, float]:
    """Host-thread seconds per micro-batch per decode layer as CGOPipe runs it: (CPU-attention micro-batch,
    GPU-attention micro-batch) on the tiny model of ``probe`` (:func:`_host_probe_spec`): "generic" (Mixtral-shaped,
    dense experts) gives the profile's host_issue_cpu_attn / host_issue_gpu_attn ((H6') in hrm.py); any other key of
    :func:`host_probe_keys` ("mla", "qwen3_moe", "mixtral/int4", "gpt_oss/mxfp4", ...) its entry of
    host_issue_by_family (the family's decode math, its experts stored in the key's format: int4 pages dequantized per
    layer visit, MXFP4 pages through their own kernel).

    Runs the executor's own decode (pre-attention, q/k/v copies, hand-offs with the CPU-attention worker, the
    attention output's transfer, page slots, post-attention with the expert FFN; for GPU attention the KV append and
    attention of every length group) on the probe's model (D = 256, ``layers`` layers, 2 experts resident per layer)
    with 2 micro-batches of ``mu`` prompts of spread lengths (8 KV length groups), so the GPU, PCIe and CPU-attention
    work are negligible and the decode time is the host's: decode seconds / (``steps`` x layers x 2), once with both
    micro-batches attending on the CPU and once with both on the GPU. A short warm-up run compiles the kernels first.
    On ``device="cpu"`` (tests) the same loop runs synchronously and both numbers are CPU-attention micro-batches.
    The CPU number includes the host's wait for each hand-off (q/k/v copy, event, worker wake-up, the tiny
    attention) that the decode's schedule (its layer look-ahead included) leaves exposed, a latency the host really
    waits per CPU micro-batch (issue time alone under-predicts a CPU micro-batch's decode layer).
    :func:`measure_microbatch_overhead` times only a bare pre + post attention, far less
    than the host spends issuing a real micro-batch's work. Raises ValueError on an unknown ``probe``.
    """
    from .cgopipe import CGOPipeExecutor
    from .sampling import DecodeSampling
    from ..policy.policy import Policy

    cuda = torch.device(device).type == "cuda"
    spec = _host_probe_spec(layers, probe)
    dt, name = (torch.bfloat16, "bf16") if cuda else (torch.float32, "fp32")
    g = torch.Generator().manual_seed(0)
    lens = torch.linspace(8, 200, 2 * mu).round().long().tolist()  # spread lengths: 8 KV groups per micro-batch
    prompts = [torch.randint(3, spec.vocab_size, (n,), generator=g).tolist() for n in lens]
    out = []
    for n_gpu in (0, 2):
        pol = Policy(mu=mu, n=2, prefill_mu=mu, resident_experts=2, n_gpu_attn=n_gpu, dtype=name, weight_quant=name)
        ex = CGOPipeExecutor(_host_probe_weights(spec, probe, dt), pol, device, ffn=_host_probe_ffn(spec, probe, cuda))
        try:
            ex.generate(prompts, DecodeSampling(max_new_tokens=3, stop_at_eos=False))  # warm-up: kernel compilation
            before = ex.stats.decode_seconds
            ex.generate(prompts, DecodeSampling(max_new_tokens=steps + 1, stop_at_eos=False))
            out.append((ex.stats.decode_seconds - before) / (steps * layers * 2))
        finally:
            ex.close()
    return out[0], out[1]


# The host probes' tiny models: config.json fields beyond _PROBE_BASE per model_type, each the family's decode math
# (its attention, norms, router, shared experts) at its Hub flagship's expert count and top-k (the host's per-expert
# work: routing, slots, pages), every layer MoE; and the expert formats its probes store ("int4": quantize's pages,
# for the families they hold; "mxfp4": gpt-oss's Hub pages). "mixtral" dense is the generic probe.
_PROBE_BASE = {"vocab_size": 256, "hidden_size": 256, "num_attention_heads": 8, "num_experts_per_tok": 2,
               "rope_theta": 1e4, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024}
HOST_PROBE_MODELS = {
    "mixtral": (dict(num_key_value_heads=2, head_dim=32, intermediate_size=512, num_local_experts=8),  # Mixtral-8x7B
                ("dense", "int4")),
    "qwen2_moe": (dict(num_key_value_heads=8, intermediate_size=512, moe_intermediate_size=128, num_experts=60,
                       num_experts_per_tok=4, shared_expert_intermediate_size=512, norm_topk_prob=False),  # Qwen1.5-MoE:
                  ("dense", "int4")),  # q/k/v biases, a gated shared expert
    "qwen3_moe": (dict(num_key_value_heads=2, head_dim=32, intermediate_size=512, moe_intermediate_size=128,
                       num_experts=128, num_experts_per_tok=8, norm_topk_prob=True),  # Qwen3-30B-A3B: q/k norms
                  ("dense", "int4")),
    "olmoe": (dict(num_key_value_heads=8, intermediate_size=128, num_experts=64, num_experts_per_tok=8),  # OLMoE-1B-7B:
              ("dense", "int4")),  # q/k norms over the whole projection
    "deepseek_v2": (dict(num_key_value_heads=8, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=64,
                         num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=0, kv_lora_rank=64,
                         q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                         topk_method="greedy", norm_topk_prob=False),  # DeepSeek-V2-Lite: MLA, 2 shared experts
                    ("dense", "int4")),
    "deepseek_v3": (dict(num_key_value_heads=8, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=256,
                         num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=64,
                         q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_group=8,
                         topk_group=4),  # DeepSeek-V3: MLA with a q LoRA, sigmoid group-limited routing
                    ("dense", "int4")),
    "gpt_oss": (dict(num_key_value_heads=2, head_dim=32, intermediate_size=128, num_local_experts=32,
                     num_experts_per_tok=4, sliding_window=128, layer_types="alternate"),  # gpt-oss-20b: sinks,
                ("dense", "mxfp4")),  # biases, sliding windows on every other layer, the clamped SwiGLU
}
# "mla": the MLA probe (DeepSeek-V2-shaped, 8 experts top-2, one shared expert), the fallback of an MLA model with
# no entry of its own (and what profiles before host_issue_by_family held as host_issue_cpu_attn_mla)
_MLA_PROBE = dict(model_type="deepseek_v2", num_key_value_heads=8, intermediate_size=512, moe_intermediate_size=512,
                  n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=64, q_lora_rank=None,
                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, topk_method="greedy", norm_topk_prob=False)


def host_probe_keys(quick: bool = False) -> tuple[str, ...]:
    """The host_issue_by_family keys ``moe-batch profile`` measures: "mla", then (not ``quick``) every registered
    family's probe of :data:`HOST_PROBE_MODELS` in each of its formats ("qwen3_moe", "mixtral/int4", ...; not
    "mixtral": that is the generic probe)."""
    from ..model.families import families

    keys = [MLA_HOST_PROBE]
    for fam in () if quick else families():
        model_type = fam.model_types[0]
        for fmt in HOST_PROBE_MODELS.get(model_type, ((), ()))[1]:
            key = model_type if fmt == "dense" else f"{model_type}/{fmt}"
            if key != "mixtral":
                keys.append(key)
    return tuple(keys)


def _host_probe_spec(layers: int, probe: str = GENERIC_HOST_PROBE):
    """The tiny model of host probe ``probe`` (:func:`measure_host_issue`): "generic" (Mixtral-shaped), "mla"
    (DeepSeek-V2-shaped, every layer MoE), or a family key of :func:`host_probe_keys` (its format part does not change
    the model). Raises ValueError on an unknown key."""
    from ..model.families import read_spec

    model_type, _, fmt = ("mixtral" if probe == GENERIC_HOST_PROBE else probe).partition("/")
    cfg = {**_PROBE_BASE, "num_hidden_layers": layers}
    if model_type == MLA_HOST_PROBE and not fmt:
        return read_spec({**cfg, **_MLA_PROBE})
    if model_type not in HOST_PROBE_MODELS or (fmt or "dense") not in HOST_PROBE_MODELS[model_type][1]:
        raise ValueError(f"unknown host probe {probe!r} (known: {GENERIC_HOST_PROBE}, {', '.join(host_probe_keys())})")
    cfg.update(HOST_PROBE_MODELS[model_type][0], model_type=model_type)
    if cfg.get("layer_types") == "alternate":  # gpt-oss: sliding and full attention layers in turn
        cfg["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    return read_spec(cfg)


def _host_probe_ffn(spec, probe: str, cuda: bool) -> str:
    """The expert FFN a probe's executor runs: Triton on CUDA where the grouped kernels compute the probe's experts
    (MXFP4 pages: the MXFP4 kernel), else the torch loop, as ``expert_ffn: auto`` picks for such a job (gpt-oss's
    dense experts: biases and the clamped SwiGLU, which CGOPipeExecutor refuses under Triton)."""
    from .expert_ffn import grouped_kernels_refusal

    scheme = "mxfp4" if probe.partition("/")[2] == "mxfp4" else None
    return "triton" if cuda and grouped_kernels_refusal(spec, "triton", scheme) is None else "torch"


def _host_probe_weights(spec, probe: str, dtype: torch.dtype):
    """Dummy weights of a probe's model (:func:`~lightning_moe.model.weights.dummy_weights`), the experts stored in
    the probe key's format: "/int4" packs them into quantize's int4 pages, "/mxfp4" draws MXFP4 pages."""
    from ..model.quantized import QuantExperts
    from ..model.weights import dummy_weights

    w = dummy_weights(spec, dtype)
    fmt = probe.partition("/")[2]
    if fmt == "int4":
        w.experts = [e if e is None else QuantExperts.quantize(e, "int4") for e in w.experts]
    elif fmt == "mxfp4":
        w.experts = [e if e is None else _dummy_mxfp4_experts(spec, seed) for seed, e in enumerate(w.experts)]
    return w


def _dummy_mxfp4_experts(spec, seed: int):
    """One layer's experts as MXFP4 pages of random codes (E2M1 nibbles), scales of 2^-6 and small fp32 biases (the
    layout gpt-oss's Hub checkpoints load as: fp32 biases)."""
    from ..kernels.mxfp4 import MXFP4_BLOCK, pack_mxfp4_pages
    from ..model.quantized import MXFP4Experts

    E, D, F = spec.num_experts, spec.hidden_size, spec.intermediate_size
    g = torch.Generator().manual_seed(seed)

    def blocks(rows: int, cols: int):
        codes = torch.randint(0, 256, (E, rows, cols // MXFP4_BLOCK, 16), generator=g, dtype=torch.uint8)
        return codes, torch.full((E, rows, cols // MXFP4_BLOCK), 127 - 6, dtype=torch.uint8)

    (gu, gu_s), (dn, dn_s) = blocks(2 * F, D), blocks(D, F)
    bias = (torch.randn(E, 2 * F, generator=g) * 0.01, torch.randn(E, D, generator=g) * 0.01)
    pages, layout = pack_mxfp4_pages(gu, gu_s, bias[0], dn, dn_s, bias[1])
    return MXFP4Experts(pages, layout)


def host_description() -> tuple[str, int, int]:
    """(description, physical cores, DRAM bytes) of this host from /proc (falls back to os/platform)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        mem = int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover
        cores = os.cpu_count() or 1
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    desc = f"{platform.node()}: {model}, {cores} cores, {mem / GiB:.0f} GiB DRAM, {platform.system()} {platform.release()}, torch {torch.__version__}"
    return desc, int(cores), mem


def profile_host(name: str = "measured", gpu_preset: str = "h200", gpu_memory: Optional[int] = None, quick: bool = False,
                 log: Callable[[str], None] = print,
                 expert_shapes: Sequence[str] = EXPERT_FFN_SHAPES,
                 host_probes: Optional[Sequence[str]] = None) -> HardwareProfile:
    """Measure this host. GPU fields come from CUDA measurements, or from ``gpu_preset`` when there is no GPU.

    quick: small sizes (seconds instead of tens of seconds; noisier). ``gpu_memory`` overrides the GPU
    memory field (e.g. a share of the device). ``log`` receives one line per measurement. ``expert_shapes``: the
    models (registry names or checkpoint directories) whose expert shape the expert-FFN kernel probe rates on CUDA
    (:func:`measure_expert_ffn_rates`; the profile's ``expert_ffn_rates``); unknown names are an error before
    anything is measured. ``host_probes``: the host_issue_by_family keys measured on CUDA (default
    :func:`host_probe_keys` of ``quick``; ``()``: the generic probe only, as a job's first measurement of its host does,
    its own key then measured on demand: app.plan.with_model_host_probe).
    """
    host_probes = host_probe_keys(quick) if host_probes is None else tuple(host_probes)
    shapes, mx_shapes = expert_shapes_of(expert_shapes), mxfp4_shapes_of(expert_shapes)
    desc, cores, mem = host_description()
    sizes = dict(nbytes=64 * MiB, repeats=2) if quick else {}
    host_bw = measure_host_bandwidth(**sizes)
    log(f"host memory copy: {host_bw / 1e9:.1f} GB/s")
    fields, which = _measure_cpu_attention_side(quick, log)
    base = get_preset(gpu_preset)
    notes = [f"CPU side measured by moe-batch profile ({which}; bandwidth under executor conditions: grouped KV "
             f"cache, worker thread)"]
    fields.update(host_memory=mem, host_memory_bandwidth=host_bw, cpu_cores=cores, host=desc,
                  date=datetime.date.today().isoformat(), name=name)
    if torch.cuda.is_available():
        fields.update(_measure_gpu_side(quick, shapes, mx_shapes, host_probes, log))
        fields.update(_measure_dram_sharing(quick, fields, log))
        notes.append("GPU side measured (pinned copies, GEMM, device copy, micro-batch issue overhead, grouped expert "
                     "kernel, expert FFN kernels per shape and T, CGOPipe host issue, CPU attention beside pinned "
                     "copies)")
    else:
        log(f"no CUDA device: GPU side skipped, GPU fields taken from preset {gpu_preset!r}")
        notes.append(f"GPU side skipped (no CUDA device): GPU fields from preset {gpu_preset!r} ({base.source})")
    if gpu_memory is not None:
        fields["gpu_memory"] = int(gpu_memory)
        notes.append(f"gpu_memory set by --gpu-memory to {gpu_memory} bytes")
    fields["source"] = "; ".join(notes)
    return replace(base, **fields)


def _measure_cpu_attention_side(quick: bool, log: Callable[[str], None]) -> tuple[dict, str]:
    """The CPU attention fields of a profile (cpu_attention_bandwidth / _flops / _overhead,
    cpu_latent_attention_flops) and the routine's name, one log line per measurement."""
    # decode-shaped calls (many rows, MT-Bench-like contexts), the shapes the executor runs: bandwidth from a
    # large call, fixed cost per call from a small one (a line t = overhead + bytes / bandwidth through both)
    attn = dict(batch=16, seq=128, repeats=2) if quick else dict(batch=512, seq=128)
    probe_bw, probe_flops, which = measure_cpu_attention(**attn)
    log(f"CPU decode attention ({which}), {attn['batch']} rows x {attn['seq']} positions, one call, main thread: "
        f"{probe_bw / 1e9:.1f} GB/s of KV, {probe_flops / 1e9:.1f} GFLOP/s")
    # the FLOP rate is a peak only where the routine is compute-bound: 8 query heads per KV head of width 64 (gpt-oss)
    #   do 2x the FLOPs per KV byte of the probe above; the profile keeps the higher rate ((H5) is a bound)
    dense = dict(batch=16, q_heads=64, kv_heads=8, seq=64, head_dim=64, repeats=2) if quick else dict(
        batch=128, q_heads=64, kv_heads=8, seq=128, head_dim=64)
    _, dense_flops, _ = measure_cpu_attention(**dense)
    cpu_flops = max(probe_flops, dense_flops)
    log(f"CPU decode attention, 64 query heads on 8 KV heads of width 64: {dense_flops / 1e9:.1f} GFLOP/s (the "
        f"profile's cpu_attention_flops: {cpu_flops / 1e9:.1f}, the higher of the two)")
    ex = dict(rows=16, mean_len=32, gen=8, layers=2, repeats=1) if quick else dict(rows=512, mean_len=128)
    cpu_bw = measure_cpu_attention_executor(**ex)
    log(f"CPU decode attention as the executor runs it (grouped KV cache, worker thread), {ex['rows']} rows, mean "
        f"{ex['mean_len']} positions: {cpu_bw / 1e9:.1f} GB/s of valid KV (the profile's cpu_attention_bandwidth)")
    if not quick:
        long_bw, _, _ = measure_cpu_attention(batch=32, seq=1024)
        log(f"  (32 rows x 1024 positions: {long_bw / 1e9:.1f} GB/s, for reference)")
        mm_bw = _time_attention(_matmul_decode_attention, batch=attn["batch"], seq=attn["seq"])
        log(f"  (unfused matmul routine at {attn['batch']} x {attn['seq']}: {mm_bw / 1e9:.1f} GB/s, for reference; "
            f"the executors use cpu_decode_attention)")
    mla_flops = measure_cpu_latent_attention(**(dict(rows=16, seq=64, repeats=2) if quick else {}))
    log(f"CPU MLA decode attention (native latent kernel, 16 heads x 576-wide latents): {mla_flops / 1e9:.1f} GFLOP/s "
        f"(the profile's cpu_latent_attention_flops; 0: no native kernel)")
    small_bw, _, _ = measure_cpu_attention(batch=16, seq=128, repeats=2 if quick else 20)
    small_bytes = 2 * 16 * 8 * 128 * 128 * 2  # K and V of 16 rows x 128 positions (bf16, 8 KV heads, hd 128)
    cpu_ovh = max(0.0, small_bytes / small_bw - small_bytes / probe_bw)  # fixed cost of a decode-shaped call
    log(f"CPU decode attention fixed cost per call (16 rows x 128 positions): {cpu_ovh * 1e3:.2f} ms")
    return dict(cpu_attention_bandwidth=cpu_bw, cpu_attention_flops=cpu_flops, cpu_latent_attention_flops=mla_flops,
                cpu_attention_overhead=cpu_ovh), which


def _measure_dram_sharing(quick: bool, fields: dict, log: Callable[[str], None]) -> dict:
    """cpu_attention_bandwidth_under_h2d and pcie_h2d_under_cpu_attention: the fractions of each rate the two keep
    together, measured in one harness (pipeline.dram_sharing, at the sizes of the profile's cpu_attention_bandwidth
    probe), times the profile's own rates alone; {} (unmeasured: the HRM has no sharing rows) if it fails or a
    fraction is 0."""
    from .dram_sharing import measure_cpu_attention_under_h2d

    sizes = dict(rows=16, mean_len=32, gen=8, layers=2) if quick else dict(rows=512, mean_len=128, gen=64, layers=4)
    windows = dict(windows=2, window_s=0.1) if quick else {}
    try:
        cpu_bw, h2d_bw = fields["cpu_attention_bandwidth"], fields["pcie_h2d"]
        layer, layer_bytes = executor_attention_layer(**sizes)
        point = measure_cpu_attention_under_h2d(layer, layer_bytes, sizes["layers"], **windows)
        fc, fh = point.fractions
        if fc <= 0 or fh <= 0:
            raise RuntimeError(f"a rate of 0 together ({point})")
    except Exception as e:  # noqa: BLE001 -- the rest of the profile stands
        log(f"CPU decode attention beside pinned H2D copies: not measured ({_failure(e)})")
        return {}
    log(f"CPU decode attention beside full-rate pinned H2D copies: {fc:.2f} of its rate alone "
        f"({point.cpu_together / 1e9:.1f} of {point.cpu_alone / 1e9:.1f} GB/s of KV in this probe), H2D {fh:.2f} "
        f"({point.h2d_together / 1e9:.1f} of {point.h2d_alone / 1e9:.1f} GB/s): the HRM's host DRAM sharing point")
    return dict(cpu_attention_bandwidth_under_h2d=fc * cpu_bw, pcie_h2d_under_cpu_attention=fh * h2d_bw)


def _failure(e: Exception) -> str:
    """``Type: first line`` of a probe's exception (at most 200 characters of the line)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _measure_gpu_side(quick: bool, shapes, mx_shapes, host_probes: Sequence[str], log: Callable[[str], None]) -> dict:
    """The CUDA fields of a profile: copies, HBM, GEMM, micro-batch overhead, then the kernel probes (each failing
    alone: the rest of the profile stands), one log line per measurement."""
    g = measure_gpu(copy_bytes=(256 * MiB if quick else 1 * GiB), gemm=(4096 if quick else 8192))
    log(f"GPU {g['gpu_name']}: h2d {g['pcie_h2d'] / 1e9:.1f} GB/s, d2h {g['pcie_d2h'] / 1e9:.1f} GB/s, "
        f"HBM {g['gpu_hbm_bandwidth'] / 1e9:.0f} GB/s, bf16 {g['gpu_flops_bf16'] / 1e12:.0f} TFLOP/s")
    fields = dict(g, microbatch_overhead=measure_microbatch_overhead())
    log(f"per-micro-batch issue overhead: {fields['microbatch_overhead'] * 1e3:.2f} ms per layer")
    try:
        fields["gpu_expert_flops"] = measure_expert_kernel_flops()
    except Exception as e:  # noqa: BLE001 - the rest of the profile stands; the HRM then uses the GEMM peak
        log(f"expert kernel probe failed ({_failure(e)}); gpu_expert_flops left at 0 (the HRM uses the GEMM peak for "
            "experts)")
    else:
        log(f"grouped expert kernel (fused_experts_triton), 4096 tokens top-2 of 8 Mixtral-8x7B experts: "
            f"{fields['gpu_expert_flops'] / 1e12:.0f} TFLOP/s (the profile's gpu_expert_flops)")
    if shapes:
        fields.update(_expert_ffn_rates_field(quick, shapes, mx_shapes, log))
    fields.update(_host_issue_fields(host_probes, log))
    fields["gpu_context_bytes"] = measure_gpu_context_bytes()
    log(f"GPU memory outside torch's allocator after the probes (CUDA context, library handles, loaded kernels): "
        f"{fields['gpu_context_bytes'] / 2**30:.2f} GiB (the profile's gpu_context_bytes; the planner reserves at "
        f"least this)")
    return fields


def measure_gpu_context_bytes() -> int:
    """Bytes the current CUDA device holds outside this process's caching allocator (total - free - reserved):
    the CUDA context, cuBLAS / cuBLASLt handles and every kernel module loaded so far. Measured after the profile's
    probes, which load the kernel families a job runs (GEMMs, Triton, attention), on an otherwise idle device (memory
    of other processes would count as this one's: the value is a bound, never too small)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return max(0, int(total - free - torch.cuda.memory_reserved()))


def _expert_ffn_rates_field(quick: bool, shapes, mx_shapes, log: Callable[[str], None]) -> dict:
    """``{"expert_ffn_rates": ...}`` from the expert-FFN kernel probe (and, for ``mx_shapes``, the MXFP4 kernel's:
    :func:`measure_mxfp4_ffn_rates`), or {} where it fails (Triton everywhere)."""
    from ..policy.hardware import NO_SYNC_KERNELS

    toks, reps = (EXPERT_FFN_TOKENS[:4], 2) if quick else (EXPERT_FFN_TOKENS, 5)
    try:
        rates = measure_expert_ffn_rates(shapes, toks, repeats=reps, log=log)
    except Exception as e:  # noqa: BLE001 - the rest of the profile stands; CGOPipe then runs Triton
        log(f"expert FFN kernel probe failed ({_failure(e)}); expert_ffn_rates left empty (Triton everywhere)")
        return {}
    mx = measure_mxfp4_ffn_rates(mx_shapes, toks, repeats=reps, log=log) if mx_shapes else ()
    picks = ", ".join(f"T={r.tokens}: {r.best_of(NO_SYNC_KERNELS)}" + (
        f" (prefill: {r.best})" if r.best != r.best_of(NO_SYNC_KERNELS) else "") for r in rates)
    log(f"expert FFN kernels by measured shape (the profile's expert_ffn_rates): {picks}")
    return {"expert_ffn_rates": rates + mx}


def _host_issue_fields(keys: Sequence[str], log: Callable[[str], None]) -> dict:
    """host_issue_cpu_attn / _gpu_attn from the generic CGOPipe host issue probe and host_issue_by_family from the
    probe of every key of ``keys`` (:func:`host_probe_keys`), one log line each ({} where the generic probe fails: no
    host stage in the HRM; a key whose probe fails is left out: its jobs take the fallback)."""
    try:
        h_c, h_g = measure_host_issue()
    except Exception as e:  # noqa: BLE001
        log(f"CGOPipe host issue probe failed ({_failure(e)}); host_issue_* left at 0 (no host stage in the HRM)")
        return {}
    log(f"CGOPipe host issue per micro-batch per decode layer, generic probe (Mixtral-shaped): {h_c * 1e3:.2f} ms "
        f"(CPU attention), {h_g * 1e3:.2f} ms (GPU attention)")
    entries = {}
    for key in keys:
        try:
            entries[key] = measure_host_issue(probe=key)
        except Exception as e:  # noqa: BLE001 - its jobs take the fallback (the family's dense, MLA or generic probe)
            log(f"  host issue probe {key} failed ({_failure(e)}); left out (its jobs take the fallback probe)")
        else:
            log(f"  probe {key}: {entries[key][0] * 1e3:.2f} ms (CPU attention), {entries[key][1] * 1e3:.2f} ms (GPU "
                f"attention) per micro-batch per decode layer")
    return dict(host_issue_cpu_attn=h_c, host_issue_gpu_attn=h_g, host_issue_by_family=entries)
