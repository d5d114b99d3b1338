"""CGOPipe's options (:class:`CGOPipeOptions`, checked once when made) and what it refuses to run.

The options are the executor's switches beside the policy; each field is documented where it is declared.
:func:`check_model` checks a model against them (before the executor copies any weight); the refusals are also
asked, before any weight is read, by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from .expert_ffn import grouped_kernels_refusal
from .kv_cache import KV_GROUPS
from .token_scores import SCORE_CHUNK_TOKENS

FFN_KINDS = ("torch", "auto", "triton", "grouped_mm", "mm_loop")


@dataclass(frozen=True)
class CGOPipeOptions:
    """The switches of a :class:`~.cgopipe.CGOPipeExecutor` (ValueError naming the field on a bad value)."""

    ffn: str = "torch"  # the expert FFN (:mod:`.expert_ffn`): "torch" (the reference expert loop, bit-identical to the
    #   serial executor), or grouped calls over dense pages, or over packed pages dequantized once per layer visit
    #   (MXFP4 pages: two MXFP4 kernel calls per visit), with the kernel "triton" (CUDA only: on the CPU the torch
    #   loop), "grouped_mm" (torch's grouped GEMM; CUDA bf16, or the CPU), "mm_loop" (one library GEMM per expert,
    #   one host sync per call; CUDA or the CPU), or "auto" (per call by ``hardware``'s measured rates, mm_loop in
    #   prefill passes only, Triton where the profile has none; CUDA only: on the CPU the torch loop)
    kv_groups: int = KV_GROUPS  # length groups per micro-batch KV cache (GroupedKVCache; the planner assumes 8)
    cpu_threads: Optional[int] = None  # None: CPU attention uses torch's intra-op thread count; n >= 1: the worker
    #   thread calls torch.set_num_threads(n) when it starts (device cpu, no worker: the executor calls it when it is
    #   made; process-wide either way; an A/B switch of bench_cgopipe.py)
    attention_h2d: str = "auto"  # how a CPU micro-batch's attention output reaches the GPU: "kernel" (a zero-copy
    #   kernel on the compute stream reads the pinned buffer over PCIe, beside the page copies), "dma" (a copy on the
    #   attention H2D stream, in issue order with the pages on the copy engine), "auto" ("kernel" where
    #   kernels.host_read.host_read_available() says a kernel can read pinned memory, else "dma"); ignored on the CPU
    page_issue: str = "after_attention"  # when a decode layer visit issues the next visit's expert pages:
    #   "after_attention" (slot k of them right after micro-batch k's attention output is on its way: a DMA output never
    #   queues behind pages on the copy engine) or "visit_start" (all of them as the visit starts, behind the visit's
    #   own pages on the weight stream: the copy engine does not wait for a CPU attention between visits; for
    #   zero-copy or GPU-attention outputs; an A/B switch of bench_cgopipe.py)
    layer_lookahead: bool = True  # a CPU micro-batch's next-layer pre-attention and CPU attention are issued as soon as
    #   its post-attention of this layer is (the worker never waits at a layer boundary for the host to finish the layer
    #   and the GPU to reach the next layer's first pre-attention); False: each layer's are issued in that layer's loop
    #   (the schedule before session 45; an A/B switch of bench_cgopipe.py)
    gpu_attention: str = "torch"  # a GPU-attention micro-batch's append + attend: "torch" (per KV length group, the
    #   family's decode_attention, bit-identical to the serial executor) or "triton" (one kernel for all groups,
    #   scores in fp32: bf16 outputs differ by rounding)
    score_chunk_tokens: int = SCORE_CHUNK_TOKENS  # rows per chunk of the scoring head in prompt_logprobs (its fp32
    #   logits + log_softmax take score_chunk_tokens * V * 8 bytes, whatever the prefill chunk's token count)
    hardware: Any = None  # the hardware profile whose expert_ffn_rates drive ffn "auto" (None: Triton everywhere)
    warmup: Optional[bool] = None  # one warm-up pass inside the first prefill; None: on CUDA only
    refill_min_free: Optional[int] = None  # free slots that trigger a refill while others decode (pipeline/refill.py);
    #   None: max(1, N // 16)

    def __post_init__(self):
        def bad(name: str, want: str) -> ValueError:
            return ValueError(f"CGOPipeExecutor: {name} must be {want}, got {getattr(self, name)!r}")

        def count(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        if not count(self.score_chunk_tokens):
            raise bad("score_chunk_tokens", "an int >= 1")
        if self.gpu_attention not in ("torch", "triton"):
            raise bad("gpu_attention", "torch or triton")
        if self.page_issue not in ("after_attention", "visit_start"):
            raise bad("page_issue", "after_attention or visit_start")
        if not isinstance(self.layer_lookahead, bool):
            raise bad("layer_lookahead", "a bool")
        if self.attention_h2d not in ("auto", "kernel", "dma"):
            raise bad("attention_h2d", "auto, kernel or dma")
        if self.cpu_threads is not None and not count(self.cpu_threads):
            raise bad("cpu_threads", "None or an int >= 1")
        if self.ffn not in FFN_KINDS:
            raise bad("ffn", "torch, auto, triton, grouped_mm or mm_loop")
        if self.refill_min_free is not None and not count(self.refill_min_free):
            raise bad("refill_min_free", "None or an int >= 1")
        if not count(self.kv_groups):
            raise bad("kv_groups", "an int >= 1")

    @classmethod
    def from_kwargs(cls, options: dict) -> "CGOPipeOptions":
        """From the executor's keyword arguments; ValueError naming an unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"CGOPipeExecutor: unknown option {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**options)

    def ffn_kind(self, cuda: bool) -> str:
        """The expert FFN strategy that runs: "triton" and "auto" need CUDA (the CPU runs the torch loop)."""
        return self.ffn if (self.ffn in ("torch", "grouped_mm", "mm_loop") or cuda) else "torch"


def cgopipe_refusal(spec) -> Optional[str]:
    """Why CGOPipe cannot run ``spec`` although the serial executor can (the family's math its caches, CPU kernel and
    expert kernels do not compute), naming the family; None when it can (every family today). What CGOPipe runs only
    in part is refused where it is asked for, by name: the grouped expert kernels for experts they do not
    compute (``expert_ffn.grouped_kernels_refusal``: dense gpt-oss experts run ``expert_ffn: torch``, which ``auto``
    picks; its MXFP4 pages also run the MXFP4 kernel, grouped_mm refused).
    Checked by the executor and, before any weight is read, by the engine."""
    return None


def check_model(spec, fam, opts: CGOPipeOptions, cuda: bool, page_scheme: Optional[str]) -> None:
    """ValueError when CGOPipe cannot run ``spec`` (family ``fam``) with ``opts``: :func:`cgopipe_refusal`, an
    attention kind it does not implement, or grouped expert kernels that cannot compute its experts (pages of
    ``page_scheme``, None: dense)."""
    why = cgopipe_refusal(spec)
    if why is not None:
        raise ValueError(f"CGOPipeExecutor: {fam.name}: {why}; use executor: serial")
    if fam.attention not in ("gqa", "gqa_sinks", "mla"):
        raise ValueError(f"CGOPipeExecutor: {fam.name}: attention {fam.attention!r} is not implemented "
                         f"(gqa, gqa_sinks, mla)")
    kind = opts.ffn_kind(cuda)
    why = grouped_kernels_refusal(spec, kind, page_scheme) if kind != "torch" else None
    if why is not None:
        raise ValueError(f"CGOPipeExecutor: expert_ffn {opts.ffn}: {why}")
