"""Native CPU decode attention over MLA's latent cache (DeepSeek multi-head latent attention), with the new token's
latent appended in the same call.

With the projections absorbed (``q_lat = [q_nope W_UK, q_pe]`` per head, the family's ``mla_absorb``), every query
head attends to ONE shared key row ``X_j = [c_j, k_pe_j]`` (width E = Dl + rd) per cached position, and the value is
the row's first Dl entries (the latent c): decode attention of one KV head shared by all Hq heads, arithmetic
intensity ~Hq FLOP per byte of cache. The kernel (C++ in :mod:`.cpu_attention`'s extension: one build, one
:func:`~.cpu_attention.native_available`) does, per item (cache row b, a block of heads; parallel over items,
longest rows first):

    X[b, L_b] = [c_new[rows[b]], kpe_new[rows[b]]]                         (append, before any item reads row b)
    for each tile of 32 positions j in [0, L_b + 1):            (the tile stays in L1/L2 for all the item's heads)
        s[h, j] = scale * q_lat[rows[b], h] . X[b, j]                  (fp32)
        online softmax over the tiles: running max m_h, sum l_h, acc_h rescaled by exp(m_old - m_new)
        acc_h += sum_j exp(s[h, j] - m_h) X[b, j, :Dl]
    out[rows[b], h] = acc_h / l_h                                      (rounded once to the storage dtype)

so each cache row is read from memory once per item (all Hq heads unless a few rows must be split over the team).
fp32 arithmetic for bf16 / fp16 / fp32 storage. ``scale`` is the model's (``MoESpec.softmax_scale``: qk_head_dim
** -0.5, times yarn's mscale^2), not E ** -0.5. The torch routine :func:`latent_attention_torch` (the family's
``latent_attention``) and the reference :func:`latent_attention_append_reference` sit beside it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import cpu_attention as _ca


def latent_attention_torch(q_lat: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, kv_lora_rank: int,
                           scale: float) -> torch.Tensor:
    """Decode attention over the latent cache in torch ops: every head attends to one shared key ``[c, k_pe]`` per
    position with logits ``q_lat . [c, k_pe] * scale``; the value is c. Scores and softmax in fp32; row b sees its
    first ``lengths[b]`` positions. q_lat: [B, Hq, Dl + rd]; cache: [B, S, Dl + rd]; lengths int64 [B].
    Returns the attention-weighted latents [B, Hq, Dl] in q_lat's dtype."""
    S, Dl = cache.shape[1], kv_lora_rank
    scores = torch.einsum("bhe,bse->bhs", q_lat.float(), cache.float()) * scale  # [B, Hq, S]
    valid = torch.arange(S, device=cache.device)[None, :] < lengths.to(cache.device)[:, None]  # [B, S]
    p = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)  # [B, Hq, S]
    return torch.einsum("bhs,bsd->bhd", p, cache[..., :Dl].float()).to(q_lat.dtype)  # [B, Hq, Dl]


def latent_attention_append(q_lat: torch.Tensor, c_new: Optional[torch.Tensor], kpe_new: Optional[torch.Tensor],
                            rows: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Append one decode token's latent per cache row and attend, writing the output rows in place (native kernel).

    Args:
        q_lat: [B, Hq, Dl + rd] absorbed queries of the caller's B rows (CPU; rows contiguous).
        c_new, kpe_new: [B, Dl] / [B, rd] the new token's latent and rope key, or both None: nothing is appended and
            each row attends over its ``lengths`` positions.
        rows: int64 [B_g]: caller row of each cache row (0 <= rows < B, distinct).
        cache: [B_g, S, Dl + rd] CPU latents of one length group (a cache tensor or a slice ``[:, :n]`` of one).
        lengths: int64 [B_g] positions cached per cache row; the new latent goes to position lengths[i] (needs
            lengths < S) and the row attends over lengths + 1 positions (without append: 1 <= lengths <= S).
        out: [B, Hq, Dl] written at the ``rows`` (other rows untouched), same dtype as the cache.
        scale: the softmax scale (``MoESpec.softmax_scale``).
    Returns ``out``. Dtypes: bf16, fp16 or fp32, one for all tensors; arithmetic in fp32. Equals
    :func:`latent_attention_append_reference` up to summation order (fp32 ~1e-6, bf16: one rounding of the output).
    Raises ValueError (shape, dtype, device, contiguity, index values) or RuntimeError without the native kernel.
    """
    return latent_attention_append_groups(q_lat, c_new, kpe_new, [rows], [cache], [lengths], out, scale,
                                          fn="latent_attention_append")


def _check_shared(fn: str, q_lat, c_new, kpe_new, out, E: int, dtype: torch.dtype) -> None:
    """The checks of the tensors every group shares (raises ValueError)."""
    if q_lat.dim() != 3 or out.dim() != 3 or q_lat.shape[2] != E or out.shape[:2] != q_lat.shape[:2] \
            or not 0 < out.shape[2] <= E:
        raise ValueError(f"{fn}: need q_lat [B, Hq, Dl + rd] = [B, Hq, {E}] and out [B, Hq, Dl], got q_lat "
                         f"{tuple(q_lat.shape)}, out {tuple(out.shape)}")
    B, Dl = q_lat.shape[0], out.shape[2]
    append = c_new is not None
    if append != (kpe_new is not None):
        raise ValueError(f"{fn}: give both c_new and kpe_new or neither")
    if append and (c_new.shape != (B, Dl) or kpe_new.shape != (B, E - Dl)):
        raise ValueError(f"{fn}: c_new / kpe_new must be [B, Dl] = {(B, Dl)} / [B, rd] = {(B, E - Dl)}, got "
                         f"{tuple(c_new.shape)} / {tuple(kpe_new.shape)}")
    new = [("c_new", c_new), ("kpe_new", kpe_new)] if append else []
    _ca.check_operands(fn, [("q_lat", q_lat), ("out", out)] + new, dtype, "q_lat, c_new, kpe_new")


def _check_group(fn: str, where: str, r, X, n, E: int, dtype: torch.dtype) -> None:
    """The checks of one group's cache, rows and lengths (raises ValueError; index values: the native call)."""
    if X.dim() != 3 or X.shape[2] != E or X.dtype != dtype or X.device.type != "cpu":
        raise ValueError(f"{fn}{where}: cache must be a CPU tensor [B_g, S, {E}] of dtype {dtype}, got "
                         f"{tuple(X.shape)} {X.dtype} on {X.device}")
    if X.stride(2) != 1 or X.stride(1) != E:
        raise ValueError(f"{fn}{where}: each position's {E} elements must be contiguous and the positions of a row "
                         f"consecutive (a cache or a slice [:, :n] of one), got strides {X.stride()}")
    Bg = X.shape[0]
    if r.dtype != torch.int64 or n.dtype != torch.int64 or r.shape != (Bg,) or n.shape != (Bg,):
        raise ValueError(f"{fn}{where}: rows and lengths must be int64 [B_g] = [{Bg}], got {r.dtype} "
                         f"{tuple(r.shape)}, {n.dtype} {tuple(n.shape)}")
    if r.device.type != "cpu" or n.device.type != "cpu":
        raise ValueError(f"{fn}{where}: rows and lengths must be on the CPU, got {r.device} / {n.device}")


def latent_attention_append_groups(q_lat: torch.Tensor, c_new: Optional[torch.Tensor],
                                   kpe_new: Optional[torch.Tensor], rows: Sequence[torch.Tensor],
                                   caches: Sequence[torch.Tensor], lengths: Sequence[torch.Tensor], out: torch.Tensor,
                                   scale: float, fn: str = "latent_attention_append_groups") -> torch.Tensor:
    """:func:`latent_attention_append` over several cache groups (the length groups of a grouped latent cache) in
    ONE native call: one parallel region over every (group, cache row, head block) item, longest rows first.
    ``rows[g]``, ``caches[g]``, ``lengths[g]`` are group g's arguments of :func:`latent_attention_append` (the same
    width and dtype in every group); the rows of all groups are distinct. Returns ``out``; the same results as one
    call per group. Raises ValueError (naming the group) or RuntimeError without the kernel."""
    if not _ca.native_available():
        raise RuntimeError(f"{fn}: the native CPU attention kernel is not available (see native_available())")
    if not (len(rows) == len(caches) == len(lengths)) or not caches:
        raise ValueError(f"{fn}: need one rows / cache / lengths per group, got {len(rows)} / {len(caches)} / "
                         f"{len(lengths)}")
    if caches[0].dim() != 3:
        raise ValueError(f"{fn}: caches must be [B_g, S, Dl + rd], got {tuple(caches[0].shape)}")
    E, dtype = caches[0].shape[2], caches[0].dtype
    _check_shared(fn, q_lat, c_new, kpe_new, out, E, dtype)
    for g, (r, X, n) in enumerate(zip(rows, caches, lengths)):
        _check_group(fn, f" (group {g})" if len(caches) > 1 else "", r, X, n, E, dtype)
    append = c_new is not None
    cn = c_new if append else q_lat.new_empty((0, out.shape[2]))
    kn = kpe_new if append else q_lat.new_empty((0, E - out.shape[2]))
    bad = _ca._module.latent_attention_append_groups(q_lat, cn, kn, [r.contiguous() for r in rows], list(caches),
                                                     [n.contiguous() for n in lengths], out, float(scale), append)
    if bad:
        raise ValueError(f"{fn}{bad}")
    return out


def latent_attention_append_reference(q_lat: torch.Tensor, c_new: Optional[torch.Tensor],
                                      kpe_new: Optional[torch.Tensor], rows: torch.Tensor, cache: torch.Tensor,
                                      lengths: torch.Tensor, out: torch.Tensor, scale: float) -> torch.Tensor:
    """Pure-torch reference of :func:`latent_attention_append` (same arguments and effects): the latent rows are
    written by indexing and the attention is :func:`latent_attention_torch`, one row at a time over its own positions."""
    n = lengths.clone()
    if c_new is not None:
        slots = torch.arange(rows.shape[0])
        cache[slots, lengths] = torch.cat([c_new[rows], kpe_new[rows]], dim=-1)
        n += 1
    for i, r in enumerate(rows.tolist()):  # row by row over its own positions (never reads past them)
        m = int(n[i])
        out[r] = latent_attention_torch(q_lat[r:r + 1], cache[i:i + 1, :m], n[i:i + 1], out.shape[2], scale)[0]
    return out
