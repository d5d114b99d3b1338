"""Expert parallelism over the processes of one host (issue 21): the serial executor's math, each process holding a
share of every layer's routed experts.

G processes (a ``torch.distributed`` group: gloo on the CPU, nccl on CUDA) run the same batches. Every process runs
the embedding, attention, the dense parts, the shared experts, the router and the head replicated (the same data, so
the same numbers); for the routed experts, process r computes only the (token, slot) pairs routed to the experts it
holds (``owners[e] == r``: e % G, or an explicit uneven split), as the weighted fp32 slot outputs [T, k, D] of the
reference order (``kernels.fused_moe.expert_slot_outputs_from``) with zeros for the other processes' slots. One
``all_reduce(sum)`` per layer combines them: every slot is non-zero in one process only, so the sum adds zeros and the
k-slot sum that follows is bit for bit the one-process result (hrm H10 prices this exchange: 2 (G - 1) / G T k D 4
bytes per GPU). Only the owned experts are copied to the device at each layer visit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F_

from ..kernels.fused_moe import expert_slot_outputs_from
from ..model.layers import ExpertWeights
from ..model.weights import ExpertsOnDisk, ModelWeights
from .serial import SerialExecutor


def expert_parallel_refusal(spec) -> Optional[str]:
    """Why expert parallelism cannot run ``spec``'s family (its experts' activation: silu only), naming it; None when
    it can. The executor and ``plan --gpus`` check it."""
    from ..model.families import family_of

    fam = family_of(spec)
    if fam.expert_activation != "silu":
        return f"expert parallelism: {fam.name}: expert activation {fam.expert_activation!r} (silu only)"
    return None


def expert_owners(num_experts: int, parts: int, split: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The process holding each expert of a layer (length ``num_experts``): e % ``parts`` by default (hrm H10's
    placement), or with ``split`` = experts per process (``parts`` counts summing to ``num_experts``, each >= 1: process
    0 holds the first split[0] experts, process 1 the next split[1], ...). Raises ValueError for a split that does not
    cover the experts."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"expert parallelism: parts must be an int >= 1, got {parts!r}")
    if split is None:
        return tuple(e % parts for e in range(num_experts))
    split = list(split)
    if len(split) != parts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in split) \
            or sum(split) != num_experts:
        raise ValueError(f"expert parallelism: split {split} must be {parts} counts >= 1 summing to {num_experts} experts")
    return tuple(r for r, c in enumerate(split) for _ in range(c))


def _own_experts(weights: ModelWeights, owned: Sequence[int]) -> ModelWeights:
    """``weights`` with each MoE layer's experts cut to ``owned`` (stacked in that order; the other layers as they
    are); experts still in the files (``ExpertsOnDisk``) are read a layer at a time and cut at once, so a process
    holds its own experts and one layer. Raises ValueError for quantized pages (not cut yet)."""
    idx = torch.tensor(list(owned), dtype=torch.int64)
    experts = []
    for layer, ew in enumerate(weights.experts):
        if ew is None:
            experts.append(None)
            continue
        if isinstance(ew, ExpertsOnDisk):
            ew = ew.read()
        if not isinstance(ew, ExpertWeights):
            raise ValueError(f"expert parallelism: layer {layer}: {type(ew).__name__} pages are not split yet "
                             f"(dense expert weights only)")
        experts.append(ExpertWeights(ew.w1.index_select(0, idx), ew.w3.index_select(0, idx), ew.w2.index_select(0, idx)))
    return replace(weights, experts=experts)


class ExpertParallelExecutor(SerialExecutor):
    """:class:`SerialExecutor` of one process of an expert-parallel group: its experts only, the routed FFN combined
    by an all_reduce per layer.

    Args:
        weights: host weights (all experts; the process keeps its own, ``owners[e] == rank``).
        rank, world: this process and the group's size (``torch.distributed`` initialized with ``world`` processes).
        owners: the process of each expert (:func:`expert_owners`; default e % world).
        device, dtype: as :class:`SerialExecutor` (on CUDA, this process's GPU).
        group: the process group of the all_reduce (default: the whole world).
        combine: False skips the all_reduce (each process keeps its own experts' share only: wrong tokens; for tests
            that show the combine is what makes the tokens right).
    """

    def __init__(self, weights: ModelWeights, rank: int, world: int, owners: Optional[Sequence[int]] = None,
                 device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None, group=None,
                 combine: bool = True):
        E = weights.spec.num_experts
        owners = tuple(owners) if owners is not None else expert_owners(E, world)
        if len(owners) != E or any(not 0 <= r < world for r in owners):
            raise ValueError(f"expert parallelism: owners {owners} must name a process in 0..{world - 1} for each of {E} experts")
        self.rank, self.world, self.owners, self.group, self.combine = rank, world, owners, group, combine
        self.owned = [e for e in range(E) if owners[e] == rank]  # this process's experts, ascending
        if not self.owned:
            raise ValueError(f"expert parallelism: process {rank} holds no expert (owners {owners})")
        super().__init__(_own_experts(weights, self.owned), device, dtype)
        why = expert_parallel_refusal(weights.spec)
        if why is not None:
            raise ValueError(why)
        self.local = {e: i for i, e in enumerate(self.owned)}  # global expert id -> row of this process's stacks
        self.experts_ffn = self._routed_ffn

    def _routed_ffn(self, h: torch.Tensor, ew: ExpertWeights, topk_w: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts of every process for h [T, D]: this process's slot outputs [T, k, D] (fp32), summed
        over the group, then over the k slots and cast to h's dtype (the reference order). Returns [T, D]."""
        loc = self.local
        slots = expert_slot_outputs_from(h, lambda e: (ew.w1[loc[e]], ew.w3[loc[e]], ew.w2[loc[e]]), self.owned,
                                         topk_w, topk_ids, act=F_.silu)  # [T, k, D]
        if self.combine:
            torch.distributed.all_reduce(slots, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return slots.sum(dim=1).to(h.dtype)  # [T, D]
