"""Grouped expert FFN for routed tokens (Mixtral layout): torch references and a Triton kernel.

Dimension key (used in every shape comment of this module):

    T  tokens in the batch (rows of ``x``)           D  hidden size (d_model)
    k  experts per token (top_k)                     F  per-expert FFN width (intermediate size)
    E  routed experts of the layer                   P  routed (token, slot) pairs, P = T * k

Weights are Hugging Face's layout (out x in):
``w1`` gate ``[E, F, D]``, ``w3`` up ``[E, F, D]``, ``w2`` down ``[E, D, F]``, and

    y[t] = sum_j topk_weights[t, j] * ( silu(x[t] w1_e^T) * (x[t] w3_e^T) ) w2_e^T,   e = topk_ids[t, j]

(Mixtral, arXiv 2401.04088, eq. 1-2; SwiGLU, Shazeer 2020.)

Contents, Triton-tutorial style (kernel, wrapper that checks / allocates / launches, reference beside it):

* :func:`moe_align` -- group the P (token, slot) pairs by expert (vLLM / Triton fused-MoE style token
  sort; optionally padded to blocks of ``block_m`` rows, one expert per block); :func:`moe_align_triton` -- the
  same grouping (no padding) as one Triton launch, which the grouped_mm and mm_loop FFNs take on CUDA.
* :func:`experts_ffn_reference` -- pure torch, loops over the experts that receive tokens. Its default
  ``order="hf"`` reproduces the op order of Hugging Face transformers >= 5 ``MixtralExperts`` (default
  ``grouped_mm`` implementation); ``"hf-eager"`` and ``"hf4"`` reproduce the eager loop of transformers
  5 and 4.x.
* :func:`fused_experts_triton` -- Triton grouped GEMMs: gate/up GEMM with SwiGLU fused, then the down
  GEMM with the routing weight fused; the k slot outputs of a token are summed in fp32 by a
  deterministic reduction (no atomics, so repeated runs are bit-identical).
* :func:`fused_moe_workspace_bytes` -- the workspace the Triton path allocates (for the memory model).
* :func:`fused_experts_grouped_mm` -- the same FFN on ``torch._grouped_mm`` (cuBLAS / CUTLASS grouped GEMMs: the
  pairs sorted by expert on the device, offsets int32 on the device, no host sync), with the Triton path's skip id,
  fp32 weighting and deterministic fp32 slot sum; :func:`grouped_mm_unsupported` says why a call cannot take it.
* :func:`fused_experts_mm_loop` -- the same FFN as one cuBLAS GEMM per expert and row block (one host wait for the
  row counts), every GEMM's row count from a fixed set (:func:`mm_loop_blocks`) that the first call runs once.
* :func:`silu_mul_triton` / :func:`moe_combine_triton` -- its element-wise epilogue on CUDA (SwiGLU into the chunk's
  columns of ``h``; the weighted slot sum in fp32 registers, one cast), references :func:`silu_mul_reference` /
  :func:`moe_combine_reference` (the torch code it runs on the CPU).

The ``@triton.jit`` kernels live in :mod:`lightning_moe.kernels._triton_kernels`, imported lazily by
:func:`_triton_kernels`: importing this module needs only torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "MoEAlignment",
    "MoEKernelConfig",
    "REFERENCE_ORDERS",
    "TRITON_ACTIVATIONS",
    "default_kernel_config",
    "experts_ffn_reference",
    "experts_ffn_reference_from",
    "experts_ffn_hf_grouped",
    "fused_experts_grouped_mm",
    "fused_experts_mm_loop",
    "fused_experts_triton",
    "fused_moe_workspace_bytes",
    "grouped_mm_available",
    "grouped_mm_gate_up_chunks",
    "grouped_mm_unsupported",
    "mm_loop_block_rows",
    "mm_loop_blocks",
    "moe_align",
    "moe_align_triton",
    "moe_align_triton_fits",
    "moe_combine_reference",
    "moe_combine_triton",
    "silu_mul_reference",
    "silu_mul_triton",
    "triton_available",
]

REFERENCE_ORDERS = ("hf", "hf-eager", "hf4")
MM_LOOP_TILE = 32  # rows of every fused_experts_mm_loop GEMM are a multiple of this (an expert's last block padded up)
MM_LOOP_MAX_ROWS = 2048  # and at most this: 64 row counts per projection, each run once per process (_mm_loop_warm)
_MM_LOOP_WARMED: dict = {}  # operand layout -> the largest tile row count _mm_loop_warm has run for it
TRITON_ACTIVATIONS = ("silu",)  # gate activations the Triton kernels (here and in quant.py) compute; the torch
#                                 references take any ``act``

# --------------------------------------------------------------------------------------------------
# helpers shared with quant.py
# --------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _interpret_mode() -> bool:
    """True when ``TRITON_INTERPRET`` is set the way Triton reads it (Triton's CPU interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def triton_available() -> bool:
    """True when the ``triton`` package is installed (found without importing it)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _check_routing(fn: str, T: int, topk_weights: Optional[torch.Tensor], topk_ids: torch.Tensor) -> int:
    """Check ``topk_ids [T, k]`` (integer) and ``topk_weights [T, k]`` (floating); return k."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"{fn}: topk_ids must be [T={T}, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"{fn}: topk_ids must be an integer tensor (int64/int32), got {topk_ids.dtype}")
    if topk_ids.shape[1] < 1:
        raise ValueError(f"{fn}: topk_ids has k=0 columns; need at least one expert per token")
    if topk_weights is not None:
        if tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(
                f"{fn}: topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}"
            )
        if not topk_weights.is_floating_point():
            raise ValueError(f"{fn}: topk_weights must be floating point (fp32 from the router), "
                             f"got {topk_weights.dtype}")
        if topk_weights.device != topk_ids.device:
            raise ValueError(f"{fn}: topk_weights on {topk_weights.device} but topk_ids on {topk_ids.device}")
    return int(topk_ids.shape[1])


def _check_id_range(fn: str, topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError if an id is outside [0, num_experts). Synchronizes a CUDA stream (reads 2 scalars)."""
    if topk_ids.numel() == 0:
        return
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"{fn}: topk_ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]")


def _check_experts(fn: str, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor) -> tuple[int, int, int]:
    """Check x [T, D] and stacked weights w1/w3 [E, F, D], w2 [E, D, F]; return (E, D, F)."""
    if x.dim() != 2:
        raise ValueError(f"{fn}: x must be [T, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{fn}: x must be floating point, got {x.dtype}")
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if w.dim() != 3:
            raise ValueError(f"{fn}: {name} must be a stacked [E, out, in] tensor, got shape {tuple(w.shape)}")
        if w.dtype != x.dtype:
            raise ValueError(f"{fn}: {name} dtype {w.dtype} != x dtype {x.dtype}")
        if w.device != x.device:
            raise ValueError(f"{fn}: {name} on {w.device} but x on {x.device}")
    E, Fd, D = w1.shape
    if x.shape[1] != D:
        raise ValueError(f"{fn}: x hidden size {x.shape[1]} != w1 in-features {D} "
                         f"(w1 is [E, F, D] = {tuple(w1.shape)})")
    if tuple(w3.shape) != (E, Fd, D):
        raise ValueError(f"{fn}: w3 must be [E, F, D] = {(E, Fd, D)} like w1, got {tuple(w3.shape)}")
    if tuple(w2.shape) != (E, D, Fd):
        raise ValueError(f"{fn}: w2 must be [E, D, F] = {(E, D, Fd)}, got {tuple(w2.shape)}")
    return E, D, Fd


# --------------------------------------------------------------------------------------------------
# token sort by expert
# --------------------------------------------------------------------------------------------------


class MoEAlignment(NamedTuple):
    """The P = T*k routed (token, slot) pairs grouped by expert (result of :func:`moe_align`).

    Pair ``p`` is ``(token p // k, slot p % k)``, i.e. the flat index into ``topk_ids.view(-1)``.
    Pairs of expert ``e`` are ``sorted_*[expert_offsets[e]:expert_offsets[e+1]]``, in increasing p.
    """

    sorted_token_idx: torch.Tensor  # [P] int64: token of each pair, pairs sorted by expert (stable)
    expert_offsets: torch.Tensor  # [E+1] int64: start of each expert's run; expert_offsets[E] = P
    sorted_pair_idx: torch.Tensor  # [P] int64: pair id p = t*k + slot, sorted by expert (stable)
    counts: torch.Tensor  # [E] int64: pairs routed to each expert
    block_m: Optional[int]  # rows per block of the padded layout (None: not built)
    padded_pair_idx: Optional[torch.Tensor]  # [max_blocks*block_m] int32: runs padded to block_m, pad = P
    block_expert: Optional[torch.Tensor]  # [max_blocks] int32: expert of each block, -1 = unused block


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: Optional[int] = None) -> MoEAlignment:
    """Group the routed (token, slot) pairs by expert.

    Args:
        topk_ids: ``[T, k]`` int64/int32 expert ids from the router, values in ``[0, num_experts)``.
        num_experts: E.
        block_m: if given, also build the block-padded layout of the Triton kernels (vLLM / Triton
            fused-MoE ``moe_align_block_size``): each expert's run is padded with the sentinel ``P``
            to a multiple of ``block_m`` rows, so that every block of ``block_m`` rows belongs to one
            expert; ``max_blocks = cdiv(P, block_m) + min(E, P)`` blocks are allocated (an upper
            bound, so no device->host synchronization is needed) and trailing unused blocks get
            expert ``-1``.

    Returns:
        :class:`MoEAlignment` (a NamedTuple whose first two fields are ``sorted_token_idx [P]`` and
        ``expert_offsets [E+1]``). Built from sort / scatter / cumsum / searchsorted only: no host sync.

    Raises:
        ValueError: bad shapes/dtypes or ``block_m < 1``. Ids are not range-checked here (that needs
        a sync); out-of-range ids give an indexing error.
    """
    fn = "moe_align"
    if topk_ids.dim() != 2:
        raise ValueError(f"{fn}: topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        raise ValueError(f"{fn}: topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if num_experts < 1:
        raise ValueError(f"{fn}: num_experts must be >= 1, got {num_experts}")
    if block_m is not None and block_m < 1:
        raise ValueError(f"{fn}: block_m must be >= 1, got {block_m}")
    T, k = topk_ids.shape
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [P]
    P = flat.numel()
    sorted_experts, sorted_pair = torch.sort(flat, stable=True)  # [P], [P]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(counts, 0)  # [E+1]
    sorted_token = torch.div(sorted_pair, max(k, 1), rounding_mode="floor")  # [P]
    if block_m is None:
        return MoEAlignment(sorted_token, offsets, sorted_pair, counts, None, None, None)

    padded_counts = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    padded_offsets[1:] = torch.cumsum(padded_counts, 0)  # [E+1]
    max_blocks = _cdiv(P, block_m) + min(num_experts, P)
    rank = torch.arange(P, device=dev) - offsets[sorted_experts]  # [P] rank within the expert's run
    dest = padded_offsets[sorted_experts] + rank  # [P] row in the padded layout
    padded_pair = torch.full((max_blocks * block_m,), P, dtype=torch.int32, device=dev)
    padded_pair[dest] = sorted_pair.to(torch.int32)
    block_start = torch.arange(max_blocks, device=dev, dtype=torch.int64) * block_m  # [max_blocks]
    # expert of block b: the e with padded_offsets[e] <= start < padded_offsets[e+1] (empty experts skipped)
    block_expert = torch.searchsorted(padded_offsets[1:].contiguous(), block_start, right=True)
    block_expert = torch.where(block_expert >= num_experts, -1, block_expert).to(torch.int32)
    return MoEAlignment(sorted_token, offsets, sorted_pair, counts, block_m, padded_pair, block_expert)


MOE_ALIGN_TRITON_MAX = 1 << 17  # moe_align_triton takes P * E_PAD up to this (one program: beyond, the device sort is faster)


def moe_align_triton_fits(num_pairs: int, num_experts: int) -> bool:
    """Whether :func:`moe_align_triton` takes ``num_pairs`` pairs over ``num_experts`` experts: its one program walks
    a ``[BLOCK, E_PAD]`` hit matrix over the pairs twice, so its time grows with ``P * E_PAD``."""
    return num_pairs * _pow2_at_least(max(num_experts, 2)) <= MOE_ALIGN_TRITON_MAX


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int) -> MoEAlignment:
    """:func:`moe_align` without ``block_m`` as one Triton launch (``_triton_kernels.moe_align_kernel``: a stable
    counting sort in one program) instead of a device sort and five small ops: the same four tensors, equal to
    :func:`moe_align`'s (its reference) for ids in ``[0, num_experts)``; no host sync.

    Args:
        topk_ids: ``[T, k]`` integer expert ids (int64 / int32 as they are; int16 / uint8, which the FFNs accept, go
            through one int32 copy), contiguous or not. Ids are not range-checked (that
            needs a sync): a pair whose id is outside ``[0, num_experts)`` is left out (``expert_offsets[E]`` counts
            only the rest, and the last rows of the sorted tensors are not written).
        num_experts: E.

    Returns:
        :class:`MoEAlignment` with ``block_m`` None.

    Raises:
        ValueError: bad shapes / dtypes, ``num_experts < 1``, ``P * E_PAD`` over ``MOE_ALIGN_TRITON_MAX``
        (:func:`moe_align_triton_fits`), CPU tensors (unless ``TRITON_INTERPRET=1``).
        RuntimeError: triton not installed.
    """
    fn = "moe_align_triton"
    if topk_ids.dim() != 2:
        raise ValueError(f"{fn}: topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"{fn}: topk_ids must be an int64/int32/int16/uint8 tensor, got {topk_ids.dtype}")
    if num_experts < 1:
        raise ValueError(f"{fn}: num_experts must be >= 1, got {num_experts}")
    _check_triton_device(fn, topk_ids)
    T, k = topk_ids.shape
    P, dev = T * k, topk_ids.device
    if not moe_align_triton_fits(P, num_experts):
        raise ValueError(f"{fn}: {P} pairs x {num_experts} experts is over the one-program limit "
                         f"(P * E_PAD <= {MOE_ALIGN_TRITON_MAX}); use moe_align")
    flat = topk_ids.reshape(-1)  # [P] (a copy only when topk_ids is not contiguous)
    if flat.dtype not in (torch.int64, torch.int32):
        flat = flat.to(torch.int32)
    sorted_pair = torch.empty(P, dtype=torch.int64, device=dev)  # [P]
    sorted_token = torch.empty(P, dtype=torch.int64, device=dev)  # [P]
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)  # [E+1]
    counts = torch.empty(num_experts, dtype=torch.int64, device=dev)  # [E]
    if P == 0:
        return MoEAlignment(sorted_token, offsets.zero_(), sorted_pair, counts.zero_(), None, None, None)
    e_pad = _pow2_at_least(max(num_experts, 2))
    _triton_kernels().moe_align_kernel[(1,)](
        flat, sorted_pair, sorted_token, offsets, counts, P, num_experts, k,
        E_PAD=e_pad, BLOCK=max(16, 8192 // e_pad), num_warps=8,
    )
    return MoEAlignment(sorted_token, offsets, sorted_pair, counts, None, None, None)


# --------------------------------------------------------------------------------------------------
# torch references
# --------------------------------------------------------------------------------------------------


def _slot_outputs(x: torch.Tensor, expert_out: Callable[[int, torch.Tensor], torch.Tensor], experts: Sequence[int],
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``order="hf"``'s per-(token, slot) products ``expert_out(e, tokens) * w`` of the pairs routed to ``experts``
    (ascending ids), in a zero ``[T*k, D]`` buffer of the promoted dtype (fp32 with fp32 weights); pairs routed
    elsewhere stay 0."""
    T, D = x.shape
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)  # [P]
    rw = topk_weights.reshape(-1)  # [P]
    y = torch.zeros((T * k, D), dtype=torch.promote_types(x.dtype, rw.dtype), device=x.device)  # [P, D]
    for e in experts:
        pairs = torch.where(flat == e)[0]  # [n_e] pair ids p = t*k + slot, ascending
        tok = torch.div(pairs, k, rounding_mode="floor")
        y[pairs] = expert_out(int(e), tok) * rw[pairs, None]
    return y


def expert_slot_outputs_from(
    x: torch.Tensor,
    get_expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    owned: Sequence[int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """The weighted per-slot outputs ``[T, k, D]`` (fp32 with fp32 weights) of :func:`experts_ffn_reference_from`'s
    ``order="hf"`` for the experts in ``owned`` only (``get_expert`` is asked for those that receive tokens, ascending);
    the slots routed to other experts are 0. Expert parallelism: the sum of these tensors over disjoint ``owned`` sets
    that cover every expert, then ``.sum(dim=1).to(x.dtype)``, is bit for bit the reference's result (each slot is
    non-zero in one tensor only, so the sum adds zeros)."""
    T, D = x.shape
    k = _check_routing("expert_slot_outputs_from", T, topk_weights, topk_ids)

    def expert_out(e: int, tok: torch.Tensor) -> torch.Tensor:
        w1e, w3e, w2e = get_expert(e)
        xs = x[tok]  # [n_e, D]
        return F.linear(act(F.linear(xs, w1e)) * F.linear(xs, w3e), w2e)  # [n_e, D]

    mine = set(owned)
    hit = [e for e in torch.unique(topk_ids).tolist() if e in mine]  # this part's experts with tokens, ascending
    return _slot_outputs(x, expert_out, hit, topk_weights, topk_ids).view(T, k, D)


def experts_ffn_reference_from(
    x: torch.Tensor,
    get_expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    num_experts: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    order: str = "hf",
    fused_gate_up: bool = False,
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """:func:`experts_ffn_reference` with the weights of expert ``e`` supplied by ``get_expert(e)``.

    ``get_expert(e)`` returns ``(w1_e [F, D], w3_e [F, D], w2_e [D, F])`` in ``x.dtype`` on ``x.device``;
    it is called once per expert that receives tokens, in increasing ``e`` (the quantized reference uses
    it to dequantize one page at a time). Arguments, result and accumulation orders as
    :func:`experts_ffn_reference`.
    """
    fn = "experts_ffn_reference"
    if order not in REFERENCE_ORDERS:
        raise ValueError(f"{fn}: order must be one of {REFERENCE_ORDERS}, got {order!r}")
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{fn}: x must be a floating [T, D] tensor, got {x.dtype} {tuple(x.shape)}")
    T, D = x.shape
    k = _check_routing(fn, T, topk_weights, topk_ids)
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"{fn}: {name} on {t.device} but x on {x.device}")
    _check_id_range(fn, topk_ids, num_experts)

    def expert_out(e: int, tok: torch.Tensor) -> torch.Tensor:
        """down(act(gate) * up) of expert e for the rows x[tok], all in x.dtype; [n_e, D]."""
        w1e, w3e, w2e = get_expert(e)
        Fd = w1e.shape[0]
        if tuple(w1e.shape) != (Fd, D) or tuple(w3e.shape) != (Fd, D) or tuple(w2e.shape) != (D, Fd):
            raise ValueError(f"{fn}: expert {e}: need w1/w3 [F, {D}] and w2 [{D}, F], got "
                             f"{tuple(w1e.shape)}, {tuple(w3e.shape)}, {tuple(w2e.shape)}")
        xs = x[tok]  # [n_e, D]
        if fused_gate_up:  # transformers >= 5: one GEMM over gate_up_proj = cat([w1, w3]), then chunk
            gate, up = F.linear(xs, torch.cat([w1e, w3e], dim=0)).chunk(2, dim=-1)  # [n_e, F] x2
        else:
            gate, up = F.linear(xs, w1e), F.linear(xs, w3e)  # [n_e, F] x2
        return F.linear(act(gate) * up, w2e)  # [n_e, D]

    hit = torch.unique(topk_ids).tolist()  # experts with tokens, ascending (one host sync)
    if order == "hf":
        # transformers >= 5 grouped_mm / batched_mm: per pair y * w (fp32), sum over the k slots in fp32
        y = _slot_outputs(x, expert_out, hit, topk_weights, topk_ids)  # [P, D]
        return y.view(T, k, D).sum(dim=1).to(x.dtype)

    # transformers eager loops: rows of an expert ordered by (slot, token) (torch.where over the [k, T]
    # mask), index_add_ into a zero buffer of x.dtype, experts in increasing id
    out = torch.zeros((T, D), dtype=x.dtype, device=x.device)  # [T, D]
    w_route = topk_weights.to(x.dtype) if order == "hf4" else topk_weights  # [T, k]
    for e in hit:
        slot, tok = torch.where((topk_ids == e).T)  # [n_e], [n_e]
        y = expert_out(int(e), tok) * w_route[tok, slot, None]  # "hf-eager": promotes to fp32; "hf4": x.dtype
        out.index_add_(0, tok, y.to(x.dtype))
    return out


def experts_ffn_reference(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    order: str = "hf",
    fused_gate_up: bool = False,
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """Routed-expert SwiGLU FFN in pure torch, looping over the experts that receive tokens.

    Per expert ``e`` (increasing id, only experts with tokens), on the rows routed to it:
    ``gate = x W1_e^T``, ``up = x W3_e^T``, ``h = act(gate) * up`` (``act``: silu, SwiGLU; a model family may
    gate with another activation), ``y = h W2_e^T``, every op in
    ``x.dtype`` (one ``F.linear`` per projection over all rows of the expert). The weighted sum then
    follows ``order`` -- the three orders of Hugging Face transformers (all identical in fp32 when k = 2):

    * ``"hf"`` (default) -- transformers >= 5 ``MixtralExperts`` with its default
      ``experts_implementation="grouped_mm"`` (also ``"batched_mm"``): ``y_p * topk_weights[p]`` per
      (token, slot) pair with the fp32 weight (type promotion: fp32 product), stored as ``[T*k, D]``
      fp32, then ``.view(T, k, D).sum(dim=1)`` (fp32) and one cast to ``x.dtype``. This is also the
      order of :func:`fused_experts_triton`'s epilogue.
    * ``"hf-eager"`` -- transformers >= 5 with ``experts_implementation="eager"``: rows of an expert
      ordered by (slot, token); ``(y * fp32 weight).to(x.dtype)`` then ``index_add_`` into a zero
      ``x.dtype`` buffer (one rounding to ``x.dtype`` per expert).
    * ``"hf4"`` -- transformers 4.x ``MixtralSparseMoeBlock``: as ``"hf-eager"`` but the routing weights
      are first cast to ``x.dtype`` (product formed in ``x.dtype``).

    Args:
        x: ``[T, D]`` activations, any floating dtype, any device.
        w1: gate ``[E, F, D]``; w3: up ``[E, F, D]``; w2: down ``[E, D, F]`` (HF out x in), dtype of x.
        topk_weights: ``[T, k]`` routing weights (fp32 from the router; renormalized for Mixtral).
        topk_ids: ``[T, k]`` int64/int32 expert ids in ``[0, E)``.
        order: ``"hf"`` | ``"hf-eager"`` | ``"hf4"`` (above).
        fused_gate_up: compute gate and up with one ``F.linear`` over ``cat([w1_e, w3_e])`` then
            ``chunk(2)``, as transformers >= 5 does with its ``gate_up_proj`` (copies the two weights per
            expert call). On CPU the separate and fused GEMMs were observed bit-identical; a GPU BLAS may
            pick a different algorithm for N = 2F.
        act: the gate's activation (default ``F.silu``). The Triton kernels implement silu only
            (``TRITON_ACTIVATIONS``).

    Returns:
        ``[T, D]`` in ``x.dtype``. Experts with no tokens are skipped; ``T = 0`` gives ``[0, D]``.

    Raises:
        ValueError: shape / dtype / device mismatch, ids outside ``[0, E)`` (checked with one host
        sync), unknown ``order``.
    """
    fn = "experts_ffn_reference"
    E, _, _ = _check_experts(fn, x, w1, w3, w2)
    return experts_ffn_reference_from(
        x, lambda e: (w1[e], w3[e], w2[e]), E, topk_weights, topk_ids, order=order, fused_gate_up=fused_gate_up,
        act=act,
    )


def _grouped_mm_like_hf(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a [S, K]`` (rows sorted by group) times ``b [G, K, N]`` per group given by cumulative ``offs [G]``.

    ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm``) when present and it accepts the
    operands, else the per-group ``torch.mm`` loop of transformers' ``_grouped_mm_fallback``.
    """
    gmm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if gmm is not None:
        try:
            return gmm(a, b, offs=offs)
        except (RuntimeError, NotImplementedError):  # e.g. operand strides not multiples of 16 bytes
            pass
    out = torch.zeros(a.shape[0], b.shape[2], device=a.device, dtype=a.dtype)
    start = 0
    for i, end in enumerate(offs.tolist()):
        if start != end:
            torch.mm(a[start:end], b[i], out=out[start:end])
        start = end
    return out


def experts_ffn_hf_grouped(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    gate_up: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Mirror of transformers >= 5 ``grouped_mm_experts_forward`` (the default Mixtral experts path).

    Same ops as transformers (``transformers/integrations/moe.py``): ``torch.sort`` of the flat ids,
    ``torch.histc`` counts, one grouped GEMM over ``gate_up = cat([w1, w3], dim=1)`` ``[E, 2F, D]``, chunk,
    ``silu(gate) * up``, grouped GEMM over ``w2``, ``* fp32 weight``, un-permute, ``view(T, k, D).sum(1)``,
    cast to ``x.dtype``. Use it where bit-identical agreement with transformers matters (fp32 on CPU:
    the grouped GEMM kernel rounds differently from ``F.linear`` by ~1e-7 relative); otherwise prefer
    :func:`experts_ffn_reference` (``order="hf"`` has the same accumulation order and, in bf16 on CPU,
    was observed bit-identical to this function).

    Args: as :func:`experts_ffn_reference`; ``gate_up`` optionally supplies the concatenated
    ``[E, 2F, D]`` weight (otherwise ``torch.cat`` copies w1 and w3 on every call).
    Returns ``[T, D]`` in ``x.dtype``. Raises ValueError like :func:`experts_ffn_reference`.
    """
    fn = "experts_ffn_hf_grouped"
    E, D, Fd = _check_experts(fn, x, w1, w3, w2)
    T = x.shape[0]
    k = _check_routing(fn, T, topk_weights, topk_ids)
    _check_id_range(fn, topk_ids, E)
    if gate_up is None:
        gate_up = torch.cat([w1, w3], dim=1)  # [E, 2F, D]
    elif tuple(gate_up.shape) != (E, 2 * Fd, D) or gate_up.dtype != x.dtype:
        raise ValueError(f"{fn}: gate_up must be [E, 2F, D] = {(E, 2 * Fd, D)} of {x.dtype}, "
                         f"got {gate_up.dtype} {tuple(gate_up.shape)}")
    sample_weights = topk_weights.reshape(-1)  # [P]
    expert_ids = topk_ids.reshape(-1)  # [P]
    expert_ids_g, perm = torch.sort(expert_ids)
    xs = x[perm // k]  # [P, D] sorted by expert
    sample_weights_g = sample_weights[perm]
    histc_input = expert_ids_g.float() if x.device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=E, min=0, max=E - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)  # [E]
    proj = _grouped_mm_like_hf(xs, gate_up.transpose(-2, -1), offsets)  # [P, 2F]
    gate, up = proj.chunk(2, dim=-1)
    proj = _grouped_mm_like_hf(F.silu(gate) * up, w2.transpose(-2, -1), offsets)  # [P, D]
    weighted = proj * sample_weights_g.unsqueeze(-1)  # [P, D] (fp32 by promotion)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=x.device)
    weighted = weighted[inv_perm]
    return weighted.view(T, k, D).sum(dim=1).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEKernelConfig:
    """Launch parameters of the grouped-expert kernels (all tile sizes are constexpr)."""

    block_m: int = 16  # rows (routed pairs) per program; every block belongs to one expert; >= 16
    block_n: int = 64  # output columns per program (F for gate/up, D for down); >= 16
    block_k: int = 64  # reduction step (D for gate/up, F for down); >= 16
    num_warps: int = 4  # warps per program
    num_stages: int = 3  # software-pipelining depth (shared-memory buffers per operand)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoEKernelConfig: {name} must be a power of two >= 16 (tl.dot), got {v}")


def default_kernel_config(num_pairs: int, num_experts: int, dtype: torch.dtype = torch.bfloat16) -> MoEKernelConfig:
    """Tile sizes from the mean rows per expert ``num_pairs / num_experts`` (decode: small, prefill: large).

    fp32 operands take twice the shared memory per tile, so their ``block_k`` is halved (the largest
    config then needs ~80 KiB of shared memory, well under an H100/H200's 227 KiB).
    """
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        cfg = MoEKernelConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)
    elif per_expert <= 64:
        cfg = MoEKernelConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    else:
        cfg = MoEKernelConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
    if dtype == torch.float32:
        cfg = replace(cfg, block_k=32)
    return cfg


def fused_moe_workspace_bytes(num_tokens: int, top_k: int, hidden_size: int, intermediate_size: int,
                              num_experts: int, dtype_bytes: int = 2, block_m: int = 64) -> int:
    """Bytes of device workspace :func:`fused_experts_triton` allocates for one call (besides the output).

    ``P = T*k`` pairs: intermediate ``h [P, F]`` in the activation dtype, slot outputs ``y [P, D]`` fp32,
    the padded pair index ``int32 [max_blocks*block_m]`` and block experts ``int32 [max_blocks]``, plus
    the sort (~5 int64 arrays of P). Use the largest ``block_m`` of :func:`default_kernel_config` (64)
    for an upper bound.
    """
    P = num_tokens * top_k
    max_blocks = _cdiv(P, block_m) + min(num_experts, P)
    return (P * intermediate_size * dtype_bytes + P * hidden_size * 4 + max_blocks * block_m * 4
            + max_blocks * 4 + 5 * P * 8 + 4 * (num_experts + 1) * 8)


_KERNEL_MODULES: dict = {}  # (module name, interpret flag) -> the imported kernels module


def _triton_kernels(module: str = "_triton_kernels"):
    """Import (lazily) and return the module holding the ``@triton.jit`` kernels: ``module`` of this package,
    ``_triton_kernels`` (the expert FFN, dequantization and decode attention) unless told otherwise.

    ``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted, so under
    ``TRITON_INTERPRET=1`` a second, separately named copy of the module is loaded from the same file.

    Raises:
        RuntimeError: triton is not installed.
    """
    interp = _interpret_mode()
    if (module, interp) in _KERNEL_MODULES:
        return _KERNEL_MODULES[module, interp]
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the host
        raise RuntimeError("the Triton kernels need the `triton` package (pip install triton)") from exc
    import importlib
    import importlib.util
    import sys

    name = __package__ + "." + module
    if not interp:
        mod = importlib.import_module(name)
    else:
        iname = name + "_interpret"
        path = os.path.join(os.path.dirname(__file__), module + ".py")
        spec = importlib.util.spec_from_file_location(iname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[iname] = mod
        spec.loader.exec_module(mod)
    _KERNEL_MODULES[module, interp] = mod
    return mod


_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_triton_device(fn: str, t: torch.Tensor) -> None:
    if not t.is_cuda and not _interpret_mode():
        raise ValueError(
            f"{fn}: tensors must be on a CUDA device (got {t.device}); "
            "set TRITON_INTERPRET=1 to run the Triton interpreter on CPU tensors"
        )


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (no TF32), so an fp32 run matches the fp32 reference tightly.
    return "ieee" if dtype == torch.float32 else "tf32"


def _sum_slots(y: torch.Tensor, T: int, k: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum_j y[t*k + j] in fp32, slots in increasing j; cast to dtype. y [P, D] fp32 -> [T, D]."""
    return y.view(T, k, D).sum(dim=1).to(dtype)


def kernel_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int, skip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(padded_pair_idx, block_expert)`` of :func:`moe_align` for the grouped kernels.

    ``skip``: ids equal to ``num_experts`` mark pairs this call does not compute (e.g. their expert is held by
    another group of the layer); they are aligned into an extra bucket whose blocks get expert -1, so the
    kernels never touch them (their rows of the slot output stay as the caller initialised them: zeros).
    """
    if not skip:
        al = moe_align(topk_ids, num_experts, block_m=block_m)
        return al.padded_pair_idx, al.block_expert
    al = moe_align(topk_ids, num_experts + 1, block_m=block_m)
    return al.padded_pair_idx, torch.where(al.block_expert >= num_experts, -1, al.block_expert)


def fused_experts_triton(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: Optional[MoEKernelConfig] = None,
    validate: bool = True,
    skip: bool = False,
) -> torch.Tensor:
    """Routed-expert SwiGLU FFN with Triton grouped GEMMs (bf16/fp16/fp32 in, fp32 accumulate).

    Steps: (1) :func:`moe_align` sorts the P = T*k pairs by expert into blocks of ``block_m`` rows;
    (2) ``_gate_up_kernel`` computes ``h = silu(x W1_e^T) * (x W3_e^T)`` per block (fp32 accumulators,
    ``h`` stored in ``x.dtype``, ``[P, F]``); (3) ``_down_kernel`` computes ``topk_weight * (h W2_e^T)``
    into ``y [P, D]`` fp32; (4) the k slot rows of each token are summed in fp32 (slot order) and cast
    to ``x.dtype``. No atomics: results are deterministic. (vLLM / Triton fused-MoE token sorting.)

    Args:
        x: ``[T, D]`` CUDA tensor, bf16 / fp16 / fp32 (fp32 uses IEEE fp32 dot products, not TF32).
        w1, w3: ``[E, F, D]``; w2: ``[E, D, F]``; same dtype and device as ``x``; any strides (e.g.
            strided views into a stacked page buffer).
        topk_weights: ``[T, k]`` floating (fp32 from the router). topk_ids: ``[T, k]`` int64/int32.
        config: tile sizes; default :func:`default_kernel_config` ``(T*k, E, x.dtype)``.
        validate: check that ids lie in ``[0, E)`` (``[0, E]`` with ``skip``; one host sync); pass False in a
            pipelined loop.
        skip: ids equal to ``E`` mark (token, slot) pairs this call does not compute: their slot adds 0 to the
            output (used by CGOPipe to run a layer's paged and resident experts as two calls without
            computing every pair twice). Cost: the slot output is zero-initialised.

    Returns:
        ``[T, D]`` in ``x.dtype``. Workspace: :func:`fused_moe_workspace_bytes`.

    Raises:
        ValueError: shape / dtype / device mismatch, CPU tensors (unless ``TRITON_INTERPRET=1``),
        out-of-range ids (when ``validate``). RuntimeError: triton not installed.
    """
    fn = "fused_experts_triton"
    E, D, Fd = _check_experts(fn, x, w1, w3, w2)
    T = x.shape[0]
    k = _check_routing(fn, T, topk_weights, topk_ids)
    if x.dtype not in _TRITON_DTYPES:
        raise ValueError(f"{fn}: x dtype must be one of {_TRITON_DTYPES}, got {x.dtype}")
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"{fn}: {name} on {t.device} but x on {x.device}")
    _check_triton_device(fn, x)
    if validate:
        _check_id_range(fn, topk_ids, E + 1 if skip else E)
    if T == 0:
        return torch.empty((0, D), dtype=x.dtype, device=x.device)
    P = T * k
    cfg = config or default_kernel_config(P, E, x.dtype)
    kern = _triton_kernels()

    padded_pair_idx, block_expert = kernel_alignment(topk_ids, E, cfg.block_m, skip)
    rw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [P]
    h = torch.empty((P, Fd), dtype=x.dtype, device=x.device)  # [P, F]
    y = (torch.zeros if skip else torch.empty)((P, D), dtype=torch.float32, device=x.device)  # [P, D]; skipped rows 0
    max_blocks = block_expert.numel()
    prec = _dot_precision(x.dtype)

    grid = (max_blocks, _cdiv(Fd, cfg.block_n))
    kern.gate_up_kernel[grid](
        x, w1, w3, h, padded_pair_idx, block_expert,
        P, D, Fd, k,
        x.stride(0), x.stride(1),
        w1.stride(0), w1.stride(1), w1.stride(2),
        w3.stride(0), w3.stride(1), w3.stride(2),
        h.stride(0), h.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=prec,
        UPCAST_DOT=_interpret_mode(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    grid = (max_blocks, _cdiv(D, cfg.block_n))
    kern.down_kernel[grid](
        h, w2, y, padded_pair_idx, block_expert, rw,
        P, D, Fd,
        h.stride(0), h.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=prec,
        UPCAST_DOT=_interpret_mode(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return _sum_slots(y, T, k, D, x.dtype)


# --------------------------------------------------------------------------------------------------
# torch._grouped_mm (library grouped GEMMs)
# --------------------------------------------------------------------------------------------------


def _grouped_mm_fn() -> Optional[Callable]:
    """``torch.nn.functional.grouped_mm`` (torch >= 2.10), else ``torch._grouped_mm``, else None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available(device: torch.device | str = "cuda") -> bool:
    """True when this torch has a grouped GEMM (``F.grouped_mm`` / ``torch._grouped_mm``) that runs on ``device``: on
    the CPU any build that has it; on CUDA a device of compute capability >= 8.0 (torch's grouped GEMM needs SM80+;
    its bf16 fast path is SM90+)."""
    if _grouped_mm_fn() is None:
        return False
    dev = torch.device(device)
    if dev.type == "cpu":
        return True
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(dev) >= (8, 0)


def _aligned16(t: torch.Tensor, dims: tuple) -> bool:
    """The data pointer and the strides of ``dims`` are multiples of 16 bytes."""
    b = t.element_size()
    return t.data_ptr() % 16 == 0 and all((t.stride(d) * b) % 16 == 0 for d in dims)


def grouped_mm_unsupported(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> Optional[str]:
    """Why :func:`fused_experts_grouped_mm` cannot run these operands (None: it can).

    torch's grouped GEMM (``aten/src/ATen/native/cuda/Blas.cpp`` ``_grouped_mm_cuda``; its meta function in
    ``torch/_meta_registrations.py`` repeats the checks): on CUDA both operands bf16; every operand's leading stride
    a multiple of 16 bytes (``x [T, D]`` and ``h [P, F]`` row-major: D and F multiples of 8 in bf16; the weights are
    passed transposed, ``w1.transpose(1, 2) [E, D, F]`` column-major with leading stride D, ``w2.transpose(1, 2)
    [E, F, D]`` with leading stride F); each expert's matrix 16-byte aligned (data pointer and expert stride), which
    the page buffers' 256-byte aligned regions and the dense scratch give. The weights need the innermost dimension
    contiguous (``w.stride(2) == 1``): the page buffers' ``[E, F, D]`` views are. On the CPU torch's fallback takes
    fp32, bf16 and fp16, with the same 16-byte stride rule (torch 2.13 checks it there too: "strides should be
    multiple of 16 bytes").
    """
    if _grouped_mm_fn() is None:
        return f"torch {torch.__version__} has no grouped_mm"
    if x.dtype not in _TRITON_DTYPES:
        return f"dtype {x.dtype}"
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if w.stride(2) != 1:
            return f"{name} innermost stride {w.stride(2)} != 1"
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16:
            return f"CUDA grouped_mm takes bfloat16 only, got {x.dtype}"
        if not grouped_mm_available(x.device):
            return f"CUDA device {x.device} has compute capability < 8.0"
    elif x.device.type != "cpu":
        return f"device {x.device}"
    D, Fd = x.shape[1], w1.shape[1]
    if (D * x.element_size()) % 16 or (Fd * x.element_size()) % 16:
        return f"D = {D} and F = {Fd} must be multiples of {16 // x.element_size()} in {x.dtype} (16-byte strides)"
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if not _aligned16(w, (0, 1)):
            return f"{name} is not 16-byte aligned (data pointer or strides {tuple(w.stride())})"
    return None


def grouped_mm_gate_up_chunks(hidden_size: int, intermediate_size: int, top_k: int, dtype_bytes: int = 2) -> int:
    """Column chunks of the gate/up grouped GEMMs of :func:`fused_experts_grouped_mm`, so its temporaries stay within
    what the planner counts for the grouped Triton kernel (hrm ``_ffn_stage_bytes``: per pair ``F b`` for the gate|up
    product, ``4 D`` fp32 slot output and ``4 D / k`` for the fp32 sum).

    Per pair the grouped_mm path holds the expert-sorted input row (``D b``) and the SwiGLU product ``h`` (``F b``),
    and while h is formed, the gate and up products of one chunk of ``F / n`` columns (``2 F b / n``); with n = 1 the
    gate and up products are the whole width and h is formed in place in the gate product (``2 F b + D b``). Returns
    the fewest of 1, 4, 8, 16 chunks whose bytes fit ``F b + 4 D + 4 D / k`` (16 if none).
    """
    D, Fd, b = hidden_size, intermediate_size, dtype_bytes
    budget = Fd * b + 4 * D + 4 * D / max(top_k, 1)
    if 2 * Fd * b + D * b <= budget:
        return 1
    for n in (4, 8):
        if Fd * b + 2 * Fd * b / n + D * b <= budget:
            return n
    return 16


# --------------------------------------------------------------------------------------------------
# element-wise epilogues of fused_experts_grouped_mm: SwiGLU and the slot combine (Triton + torch reference)
# --------------------------------------------------------------------------------------------------

_EPILOGUE_TILE = 2048  # elements per program of the epilogue kernels (memory-bound: 16-byte vector accesses)


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out = silu(gate) * up`` as torch computes it in ``gate.dtype``: ``F.silu`` (fp32 from ``gate``, rounded to
    the dtype) **in place in gate**, then ``torch.mul`` (the product in fp32, rounded once) into ``out`` (default:
    ``gate`` itself). ``gate`` / ``up`` / ``out`` ``[M, N]``; ``out`` may be a strided view (a column slice of a wider
    buffer). The torch epilogue of :func:`fused_experts_grouped_mm` (no temporary beyond ``up``); reference of
    :func:`silu_mul_triton`. Returns ``out``."""
    out = gate if out is None else out
    return torch.mul(F.silu(gate, inplace=True), up, out=out)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out = round(round(silu(gate)) * up)`` in one Triton pass (``_triton_kernels.silu_mul_kernel``), with the
    roundings of :func:`silu_mul_reference`: ``silu(g) = g / (1 + exp(-g))`` in fp32 (IEEE division; on CUDA
    libdevice's ``expf``, which torch's CUDA silu calls) rounded to the dtype, its product with ``up`` in fp32
    rounded once. ``gate`` is not modified unless it is ``out`` (the default: in place).

    Args:
        gate, up: ``[M, N]``, bf16 / fp16 / fp32, same dtype and device, rows of any stride, last dim contiguous.
        out: ``[M, N]`` of the same dtype, rows of any stride (e.g. ``h[:, f0:f1]``), last dim contiguous; ``gate``
            itself or memory overlapping neither input.

    Returns:
        ``out``.

    Raises:
        ValueError: shape / dtype / device / stride mismatch, CPU tensors (unless ``TRITON_INTERPRET=1``).
        RuntimeError: triton not installed.
    """
    fn = "silu_mul_triton"
    out = gate if out is None else out
    for name, t in (("gate", gate), ("up", up), ("out", out)):
        if t.dim() != 2 or tuple(t.shape) != tuple(gate.shape):
            raise ValueError(f"{fn}: {name} must be [M, N] = {tuple(gate.shape)}, got shape {tuple(t.shape)}")
        if t.dtype != gate.dtype:
            raise ValueError(f"{fn}: {name} dtype {t.dtype} != gate dtype {gate.dtype}")
        if t.device != gate.device:
            raise ValueError(f"{fn}: {name} on {t.device} but gate on {gate.device}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{fn}: {name} needs a contiguous last dim (stride 1), got strides {tuple(t.stride())}")
    if gate.dtype not in _TRITON_DTYPES:
        raise ValueError(f"{fn}: dtype must be one of {_TRITON_DTYPES}, got {gate.dtype}")
    _check_triton_device(fn, gate)
    M, N = gate.shape
    if M == 0 or N == 0:
        return out
    kern = _triton_kernels()
    interp = _interpret_mode()
    block_n = min(1024, _pow2_at_least(N))
    block_m = max(1, _EPILOGUE_TILE // block_n)
    grid = (_cdiv(M, block_m), _cdiv(N, block_n))
    kern.silu_mul_kernel[grid](
        gate, up, out, M, N, gate.stride(0), up.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, LIBDEVICE_EXP=not interp,
        RNE_BY_HAND=interp and gate.dtype == torch.bfloat16, num_warps=4,
    )
    return out


def _check_combine(fn: str, yd: torch.Tensor, rank: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: Optional[torch.Tensor], skip: bool) -> tuple[int, int]:
    """Check the operands of :func:`moe_combine_triton` / :func:`moe_combine_reference`; return (T, k)."""
    if yd.dim() != 2 or not yd.is_floating_point():
        raise ValueError(f"{fn}: yd must be a floating [P, D] tensor, got {yd.dtype} {tuple(yd.shape)}")
    if rank.dim() != 2 or rank.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{fn}: rank must be an int64/int32 [T, k] tensor, got {rank.dtype} {tuple(rank.shape)}")
    T = rank.shape[0]
    if topk_ids is None:
        if skip:
            raise ValueError(f"{fn}: skip needs topk_ids")
        topk_ids = rank
    k = _check_routing(fn, T, topk_weights, topk_ids)
    if tuple(rank.shape) != (T, k):
        raise ValueError(f"{fn}: rank shape {tuple(rank.shape)} != topk_ids shape {(T, k)}")
    for name, t in (("rank", rank), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != yd.device:
            raise ValueError(f"{fn}: {name} on {t.device} but yd on {yd.device}")
    return T, k


def moe_combine_reference(yd: torch.Tensor, rank: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                          skip: bool = False) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * yd[rank[t, j]]`` in an fp32 ``[T, D]`` buffer from 0, slots in increasing
    j (``addcmul_``), cast once to ``yd.dtype``; with ``skip`` a pair whose id equals ``num_experts`` adds 0 (its row
    is gathered, then replaced by 0 with ``torch.where``: it may hold NaN). The torch combine of
    :func:`fused_experts_grouped_mm`; reference of :func:`moe_combine_triton`. yd ``[P, D]``, rank / topk_weights /
    topk_ids ``[T, k]`` -> ``[T, D]``."""
    T, k = _check_combine("moe_combine_reference", yd, rank, topk_weights, topk_ids, skip)
    rw = topk_weights.to(torch.float32)  # [T, k]
    out = torch.zeros((T, yd.shape[1]), dtype=torch.float32, device=yd.device)  # [T, D] fp32 slot sum
    for j in range(k):
        yj = yd[rank[:, j]].float()  # [T, D]
        if skip:  # a skipped pair's row of yd was never written (it may hold NaN): select, never multiply
            yj = torch.where((topk_ids[:, j] == num_experts)[:, None], 0.0, yj)
        out.addcmul_(yj, rw[:, j:j + 1])
    return out.to(yd.dtype)


def moe_combine_triton(yd: torch.Tensor, rank: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                       skip: bool = False) -> torch.Tensor:
    """The slot combine of :func:`moe_combine_reference` in one Triton pass (``_triton_kernels.moe_combine_kernel``):
    per token and column block an fp32 register accumulator from 0, ``+= float(topk_weights[t, j]) *
    float(yd[rank[t, j]])`` for j = 0 .. k-1, one cast to ``yd.dtype``; with ``skip`` the rows of pairs whose id is
    ``num_experts`` are never loaded and add exactly 0. No fp32 ``[T, D]`` buffer: it reads ``k`` rows and writes one
    per token. Differs from the reference only by FMA contraction of the fp32 multiply-add (compiled code): within
    one ulp of the dtype after the cast.

    Args:
        yd: ``[P, D]`` bf16 / fp16 / fp32, rows of any stride, last dim contiguous.
        rank: ``[T, k]`` int64 / int32, values in ``[0, P)`` (not checked: that would sync the device).
        topk_weights: ``[T, k]`` floating (converted to fp32 in the kernel). topk_ids: ``[T, k]`` integer; read only
            with ``skip``. num_experts: the skip id.

    Returns:
        ``[T, D]`` in ``yd.dtype``.

    Raises:
        ValueError: shape / dtype / device mismatch, CPU tensors (unless ``TRITON_INTERPRET=1``).
        RuntimeError: triton not installed.
    """
    fn = "moe_combine_triton"
    T, k = _check_combine(fn, yd, rank, topk_weights, topk_ids, skip)
    if yd.dtype not in _TRITON_DTYPES:
        raise ValueError(f"{fn}: yd dtype must be one of {_TRITON_DTYPES}, got {yd.dtype}")
    D = yd.shape[1]
    if D > 1 and yd.stride(1) != 1:
        raise ValueError(f"{fn}: yd needs a contiguous last dim (stride 1), got strides {tuple(yd.stride())}")
    if skip and num_experts is None:
        raise ValueError(f"{fn}: skip needs num_experts (the skip id)")
    _check_triton_device(fn, yd)
    out = torch.empty((T, D), dtype=yd.dtype, device=yd.device)
    if T == 0 or D == 0:
        return out
    kern = _triton_kernels()
    interp = _interpret_mode()
    ids = topk_ids if skip else rank  # not read without skip
    block_d = min(1024, _pow2_at_least(D))
    kern.moe_combine_kernel[(T, _cdiv(D, block_d))](
        yd, rank, topk_weights, ids, out, D, k, int(num_experts) if skip else -1,
        yd.stride(0), rank.stride(0), rank.stride(1), topk_weights.stride(0), topk_weights.stride(1),
        ids.stride(0), ids.stride(1), out.stride(0),
        SKIP=skip, BLOCK_D=block_d, RNE_BY_HAND=interp and yd.dtype == torch.bfloat16, num_warps=4,
    )
    return out


def fused_experts_grouped_mm(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    validate: bool = True,
    skip: bool = False,
    gate_up_chunks: Optional[int] = None,
    _epilogue: Optional[str] = None,
) -> torch.Tensor:
    """Routed-expert SwiGLU FFN with torch's grouped GEMM (``F.grouped_mm`` / ``torch._grouped_mm``): the arguments,
    the result and the skip id of :func:`fused_experts_triton`.

    Steps, all on the device with no host sync: (1) :func:`moe_align` sorts the P = T*k pairs by expert (stable;
    with ``skip`` the skipped pairs form a last bucket, id E; with the Triton epilogue, :func:`moe_align_triton`
    where :func:`moe_align_triton_fits`: one launch instead of a device sort and five small ops); the E group ends
    ``offs`` are int32 on the device and the skipped pairs lie past ``offs[E-1]``, where grouped_mm writes nothing; (2) ``xs = x[sorted tokens]`` [P, D];
    (3) per column chunk (:func:`grouped_mm_gate_up_chunks`) ``gate = xs W1_e^T``, ``up = xs W3_e^T`` (grouped GEMMs
    over the transposed weight views, no copy) and ``h = silu(gate) * up`` [P, F] in ``x.dtype`` (:func:`silu_mul_triton`
    / :func:`silu_mul_reference`); (4) ``yd = h W2_e^T`` [P, D] in ``x.dtype``; (5) per slot j (increasing): ``out +=
    topk_weight[:, j] * yd[rank of pair (t, j)]`` in fp32 (skipped pairs add 0), one cast to ``x.dtype``
    (:func:`moe_combine_triton`: in registers, no fp32 [T, D] buffer / :func:`moe_combine_reference`). Deterministic
    (no atomics). Differs from the Triton kernel in roundings only: gate/up/down products are rounded to ``x.dtype``
    before SwiGLU and before the fp32 weighting (as transformers' grouped_mm path does).

    The epilogue (steps 3's SwiGLU and 5) runs as two Triton kernels on CUDA when triton is installed, else as the
    torch code of the references; the two agree bit for bit in the SwiGLU (on CUDA; see the kernels' tests) and
    within one ulp of ``x.dtype`` in the combine (FMA contraction of the fp32 multiply-add).

    Args:
        x: ``[T, D]``; bf16 on CUDA (compute capability >= 8.0), fp32 / bf16 / fp16 on the CPU.
        w1, w3: ``[E, F, D]``; w2: ``[E, D, F]``; same dtype and device as ``x``, innermost dim contiguous (strided
            views of a page buffer are fine: :func:`grouped_mm_unsupported` lists the alignment rules).
        topk_weights: ``[T, k]`` floating. topk_ids: ``[T, k]`` integer ids in ``[0, E)`` (``[0, E]`` with ``skip``).
        validate: check the id range (one host sync); pass False in a pipelined loop.
        skip: ids equal to ``E`` mark pairs this call does not compute (their slot adds 0).
        gate_up_chunks: column chunks of the gate/up GEMMs (default :func:`grouped_mm_gate_up_chunks`: the planner's
            FFN workspace); 1 = two full-width GEMMs.
        _epilogue: tests only: "triton" or "torch" forces the epilogue (None: Triton on CUDA when triton is
            installed; "triton" on CPU tensors needs ``TRITON_INTERPRET=1``).

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: shape / dtype / device mismatch, operands grouped_mm cannot take (the reason), out-of-range ids
        (when ``validate``), ``gate_up_chunks`` < 1, an unknown ``_epilogue``.
    """
    return _sorted_experts_ffn("fused_experts_grouped_mm", x, w1, w3, w2, topk_weights, topk_ids, validate, skip,
                               gate_up_chunks, _epilogue, per_expert=False)


def fused_experts_mm_loop(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    validate: bool = True,
    skip: bool = False,
    gate_up_chunks: Optional[int] = None,
    _epilogue: Optional[str] = None,
) -> torch.Tensor:
    """Routed-expert SwiGLU FFN as one library GEMM (``torch.mm``: cuBLAS on CUDA) per expert and projection: the
    arguments, the result and the roundings of :func:`fused_experts_grouped_mm`, whose steps it shares but for the
    GEMMs.

    The GEMMs need each expert's row count on the host: after the sort by expert (:func:`moe_align_triton` /
    :func:`moe_align`, as :func:`fused_experts_grouped_mm`) the E + 1 group bounds are copied to pinned host memory
    (non-blocking, on CUDA), the buffers are allocated and the expert-sorted gather ``xs = x[sorted tokens]`` is
    queued, and only then does the host wait for the bounds, so the GPU gathers while the host waits and the host
    has only the GEMM launches left after it: ONE host sync per call. Then per
    block (e, s, m) of :func:`mm_loop_blocks`: ``h[s:s+m] = xs[s:s+m] W1_e^T`` (written in place), ``up = xs[s:s+m]
    W3_e^T`` (one reused [block, F] buffer), ``h[s:s+m] = silu(h[s:s+m]) * up``; then per block ``yd[s:s+m] =
    h[s:s+m] W2_e^T``; the combine of :func:`fused_experts_grouped_mm`. A block holds at most ``2 P / n`` rows (n =
    ``gate_up_chunks``, default :func:`grouped_mm_gate_up_chunks`; n = 1: P), so ``up`` stays within the grouped_mm
    path's chunk temporaries, and at most ``MM_LOOP_MAX_ROWS``; an expert's last block is padded up to a multiple of
    ``MM_LOOP_TILE`` rows (experts in ascending order: the padding rows belong to later experts, which overwrite
    them, or to ``MM_LOOP_TILE`` spare rows of ``xs``, ``h`` and ``yd``). So every GEMM has one of 64 row counts,
    and on CUDA each is run once per process and operand layout on the first call (:func:`_mm_loop_warm`): cuBLAS
    picks a kernel per shape and loads it on first use, a few milliseconds each. Experts with no rows launch nothing;
    skipped pairs (``skip``) are not computed.

    Faster than one grouped GEMM where a call's per-expert row counts are a few 128-row tiles (cuBLAS picks its tile
    per shape; torch's grouped GEMM has one tile config); the host sync keeps it out of the decode loop (the
    executor runs it in prefill passes only, where the profile measures it faster: ``policy.hardware``).

    Args, Returns: as :func:`fused_experts_grouped_mm`; any dtype ``torch.mm`` takes on the device (no 16-byte rule).

    Raises:
        ValueError: shape / dtype / device mismatch, out-of-range ids (when ``validate``), ``gate_up_chunks`` < 1, an
        unknown ``_epilogue``.
    """
    return _sorted_experts_ffn("fused_experts_mm_loop", x, w1, w3, w2, topk_weights, topk_ids, validate, skip,
                               gate_up_chunks, _epilogue, per_expert=True)


def _host_bounds(offsets: torch.Tensor, then: Callable[[], torch.Tensor]) -> tuple[list, torch.Tensor]:
    """``offsets`` (a device tensor) as a host list, and the result of ``then()``, queued before the host waits for
    the copy (on CUDA: a non-blocking copy into pinned memory, an event, ``then()``, the event's wait)."""
    if offsets.device.type != "cuda":
        return offsets.tolist(), then()
    host = torch.empty(offsets.shape, dtype=offsets.dtype, pin_memory=True)
    host.copy_(offsets, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    out = then()
    copied.synchronize()
    return host.tolist(), out


def mm_loop_block_rows(P: int, gate_up_chunks: int) -> int:
    """Rows of one mm_loop row block for ``P`` pairs: ``2 P / n`` (n = ``gate_up_chunks``; ``P`` for n = 1), so the
    ``up`` temporary [block, F] stays within the grouped_mm path's chunk temporaries, rounded down to a multiple of
    ``MM_LOOP_TILE`` and kept within ``[MM_LOOP_TILE, MM_LOOP_MAX_ROWS]``."""
    cap = P if gate_up_chunks == 1 else _cdiv(2 * P, gate_up_chunks)
    return min(MM_LOOP_MAX_ROWS, max(MM_LOOP_TILE, cap // MM_LOOP_TILE * MM_LOOP_TILE))


def mm_loop_blocks(bounds: Sequence[int], block: int) -> list[tuple[int, int, int]]:
    """The mm_loop GEMMs as (expert e, first row s, rows m), experts in ascending order: expert e's r rows
    ``bounds[e]:bounds[e+1]`` in ``ceil(r / block)`` blocks of equal size rounded up to a multiple of
    ``MM_LOOP_TILE`` (no short tail block beside a full one: an expert of 2070 rows is two GEMMs of 1056 and 1024
    rows, not 2048 and 32), each at most ``block`` rows (a multiple of ``MM_LOOP_TILE``); the last block padded up to
    a multiple of ``MM_LOOP_TILE``. A padded block runs into the rows of the experts after e, which their own GEMMs
    overwrite later, or past ``bounds[E]`` into the skipped pairs' rows and the ``MM_LOOP_TILE`` spare rows of the
    buffers. Every m is one of the ``MM_LOOP_MAX_ROWS / MM_LOOP_TILE`` tile row counts."""
    out = []
    for e in range(len(bounds) - 1):
        r = bounds[e + 1] - bounds[e]
        if r <= 0:
            continue
        step = _cdiv(_cdiv(r, _cdiv(r, block)), MM_LOOP_TILE) * MM_LOOP_TILE  # <= block
        for s in range(bounds[e], bounds[e + 1], step):
            out.append((e, s, _cdiv(min(step, bounds[e + 1] - s), MM_LOOP_TILE) * MM_LOOP_TILE))
    return out


def _warms_tiles(x: torch.Tensor) -> bool:
    """Whether :func:`_mm_loop_ffn` runs :func:`_mm_loop_warm`: on CUDA (cuBLAS's first call of a shape); the CPU's
    BLAS has no per-shape first-call cost to move."""
    return x.is_cuda


def _mm_loop_warm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, rows: int) -> None:
    """``torch.mm(a[:m], w.T, out=out[:m])`` once for each tile row count m <= ``rows`` not yet run in this process
    for this operand layout (device, dtype, the weight's shape and strides), into the call's own buffers before its
    real GEMMs write them. The library's one-time work for a new shape (cuBLAS's heuristic, the lazy load of the
    kernel it picks) then happens in the first call, which the executor's warm-up makes, and not in whichever later
    call first meets that row count."""
    key = (a.device, a.dtype, tuple(w.shape), w.stride())
    done = _MM_LOOP_WARMED.get(key, 0)
    top = rows // MM_LOOP_TILE * MM_LOOP_TILE
    for m in range(done + MM_LOOP_TILE, top + 1, MM_LOOP_TILE):
        torch.mm(a[:m], w.T, out=out[:m])
    _MM_LOOP_WARMED[key] = max(done, top)


def _mm_loop_ffn(x: torch.Tensor, sorted_token_idx: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor,
                 w3: torch.Tensor, w2: torch.Tensor, n_chunks: int, silu_mul: Callable) -> torch.Tensor:
    """yd [P, D] = (silu(xs W1_e^T) * (xs W3_e^T)) W2_e^T per expert e over its expert-sorted rows xs, one
    ``torch.mm`` per block of :func:`mm_loop_blocks` and projection, with one host wait for the group bounds
    ``offsets`` [E+1] (:func:`_host_bounds`). Everything that does not need the bounds comes before the wait (the
    buffers, the gather, on CUDA the first call's tile row counts: :func:`_mm_loop_warm`), so after it the host only
    splits the rows into blocks and launches the GEMMs. Rows past ``bounds[E]`` hold whatever the padding wrote.

    No GEMM reads uninitialized memory: ``xs``'s ``MM_LOOP_TILE`` spare rows are zeroed (``MM_LOOP_TILE x D``
    elements per call, next to the ``P x D`` gather), so every padded block's rows are defined; ``h``'s rows of a
    block are written by that block's gate/up GEMMs before its down GEMM reads them (on CUDA the first call's
    warm-up writes ``h[:block]`` from ``xs`` before that). Padding rows are dropped, never summed: only the skipped
    pairs' rows of ``yd`` may stay unwritten, and the combine selects 0 for them."""
    P, D, Fd = sorted_token_idx.numel(), x.shape[1], w1.shape[1]
    block = mm_loop_block_rows(P, n_chunks)
    xs = torch.empty((P + MM_LOOP_TILE, D), dtype=x.dtype, device=x.device)  # [P + tile, D]: spare rows for padding
    h = torch.empty((P + MM_LOOP_TILE, Fd), dtype=x.dtype, device=x.device)  # [P + tile, F]
    up = torch.empty((block, Fd), dtype=x.dtype, device=x.device)  # [block, F], reused by every block

    def before_the_wait() -> None:  # queued after the bounds' copy: the GPU runs it while the host waits
        torch.index_select(x, 0, sorted_token_idx, out=xs[:P])
        xs[P:].zero_()  # the spare rows the last padded block reads: defined, never uninitialized memory (issue 41)
        if _warms_tiles(x):
            _mm_loop_warm(xs, w1[0], h, block)
            _mm_loop_warm(xs, w3[0], up, block)

    bounds, _ = _host_bounds(offsets, before_the_wait)  # E+1 bounds
    blocks = mm_loop_blocks(bounds, block)
    for e, s, m in blocks:  # ascending experts: a block's padding rows are overwritten by the experts after it
        torch.mm(xs[s:s + m], w1[e].T, out=h[s:s + m])  # [m, F] gate, in place in h
        silu_mul(h[s:s + m], torch.mm(xs[s:s + m], w3[e].T, out=up[:m]), h[s:s + m])  # silu(gate) * up
    xs = up = None
    yd = torch.empty((P + MM_LOOP_TILE, D), dtype=x.dtype, device=x.device)  # [P + tile, D]
    if _warms_tiles(x):
        _mm_loop_warm(h, w2[0], yd, block)
    for e, s, m in blocks:
        torch.mm(h[s:s + m], w2[e].T, out=yd[s:s + m])  # [m, D]
    return yd[:P]


def _sorted_experts_ffn(fn: str, x, w1, w3, w2, topk_weights, topk_ids, validate: bool, skip: bool,
                        gate_up_chunks: Optional[int], _epilogue: Optional[str], per_expert: bool) -> torch.Tensor:
    """The body of :func:`fused_experts_grouped_mm` (``per_expert`` False) and :func:`fused_experts_mm_loop` (True):
    checks, the sort by expert, the gather, the GEMMs with the SwiGLU, the combine."""
    E, D, Fd = _check_experts(fn, x, w1, w3, w2)
    T = x.shape[0]
    k = _check_routing(fn, T, topk_weights, topk_ids)
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"{fn}: {name} on {t.device} but x on {x.device}")
    if not per_expert:
        why = grouped_mm_unsupported(x, w1, w3, w2)
        if why is not None:
            raise ValueError(f"{fn}: grouped_mm cannot take these operands: {why}")
    n_chunks = gate_up_chunks or grouped_mm_gate_up_chunks(D, Fd, k, x.element_size())
    if n_chunks < 1:
        raise ValueError(f"{fn}: gate_up_chunks must be >= 1, got {gate_up_chunks}")
    epilogue = _epilogue or ("triton" if x.is_cuda and triton_available() else "torch")
    if epilogue not in ("triton", "torch"):
        raise ValueError(f"{fn}: _epilogue must be 'triton', 'torch' or None, got {_epilogue!r}")
    if validate:
        _check_id_range(fn, topk_ids, E + 1 if skip else E)
    if T == 0:
        return torch.empty((0, D), dtype=x.dtype, device=x.device)
    silu_mul = silu_mul_triton if epilogue == "triton" else silu_mul_reference
    E_al = E + 1 if skip else E  # the skip bucket (id E) last
    fast_align = epilogue == "triton" and moe_align_triton_fits(topk_ids.numel(), E_al)
    al = (moe_align_triton if fast_align else moe_align)(topk_ids, E_al)  # stable sort by expert
    if per_expert:
        yd = _mm_loop_ffn(x, al.sorted_token_idx, al.expert_offsets[:E + 1], w1, w3, w2, n_chunks, silu_mul)  # [P, D]
    else:
        gmm = _grouped_mm_fn()
        offs = al.expert_offsets[1:E + 1].to(torch.int32)  # [E] end of each expert's rows; skipped pairs lie beyond
        xs = x[al.sorted_token_idx]  # [P, D] rows sorted by expert
        if n_chunks == 1:
            h = gmm(xs, w1.transpose(1, 2), offs=offs)  # [P, F] gate
            h = silu_mul(h, gmm(xs, w3.transpose(1, 2), offs=offs), h)  # [P, F] silu(gate) * up, in place in the gate
        else:
            h = torch.empty((xs.shape[0], Fd), dtype=x.dtype, device=x.device)  # [P, F]
            step = _cdiv(_cdiv(Fd, n_chunks), 8) * 8  # chunk width: a multiple of 8 keeps 16-byte strides in bf16
            for f0 in range(0, Fd, step):
                f1 = min(Fd, f0 + step)
                g = gmm(xs, w1[:, f0:f1].transpose(1, 2), offs=offs)  # [P, f1-f0]
                silu_mul(g, gmm(xs, w3[:, f0:f1].transpose(1, 2), offs=offs), h[:, f0:f1])
                g = None
        xs = None
        yd = gmm(h, w2.transpose(1, 2), offs=offs)  # [P, D] in x.dtype; rows of skipped pairs unwritten
    h = None
    rank = torch.empty_like(al.sorted_pair_idx)  # [P] row of pair p = t*k + j in the sorted order
    rank[al.sorted_pair_idx] = torch.arange(rank.numel(), device=x.device)
    rank = rank.view(T, k)
    combine = moe_combine_triton if epilogue == "triton" else moe_combine_reference
    return combine(yd, rank, topk_weights, topk_ids, E, skip)
