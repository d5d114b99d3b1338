"""GPU kernels of the expert FFN, each with a pure-torch reference beside it.

This subpackage imports nothing from the rest of ``lightning_moe`` and needs only torch to import;
Triton is imported lazily, the first time a ``*_triton`` function is called.

* :mod:`.fused_moe` -- token sort by expert (:func:`moe_align`), the reference expert FFN
  (:func:`experts_ffn_reference`, transformers' accumulation orders), a mirror of transformers' grouped
  path (:func:`experts_ffn_hf_grouped`), the Triton grouped SwiGLU FFN (:func:`fused_experts_triton`), and the FFN
  on torch's grouped GEMM (:func:`fused_experts_grouped_mm`) or on one library GEMM per expert
  (:func:`fused_experts_mm_loop`: one host wait per call) with their Triton epilogue (``silu_mul_triton``,
  ``moe_combine_triton``; references ``silu_mul_reference``, ``moe_combine_reference``).
* :mod:`.pages` -- the layout of a page (:class:`PageLayout`: named tensors at byte offsets in one ``uint8``
  buffer, read back as zero-copy views); the expert pages and the executor's pool pages are both laid out by it.
* :mod:`.quant` -- group-wise int4 / int2 quantization, fixed-size expert pages
  (:func:`expert_page_layout` -> :class:`ExpertPageLayout`, :func:`pack_expert_page`,
  :func:`unpack_expert_page`), and the FFN computed from packed pages or quantized tensors
  (:func:`fused_experts_paged_triton`, :func:`fused_experts_quant_triton`; references :func:`experts_ffn_quant_reference`,
  :func:`experts_ffn_qt_reference`), and the Triton dequantization of packed experts into dense weights
  (:func:`dequantize_triton`, :func:`dequantize_pages_triton`; references :func:`dequantize`,
  :func:`unpack_expert_page`) that their default "dequant" mode uses.
* :mod:`.mxfp4` -- MXFP4 (gpt-oss's E2M1 blocks with E8M0 scales): :func:`mxfp4_dequantize` (transformers' bit for
  bit), packed MXFP4 expert pages (:func:`mxfp4_page_layout` -> :class:`MXFP4PageLayout`, :func:`pack_mxfp4_pages`,
  :func:`unpack_mxfp4_page`), and gpt-oss's expert FFN from them (:func:`fused_experts_mxfp4_triton`, dequantizing
  in registers; reference :func:`experts_ffn_mxfp4_reference`).
* :mod:`.norm_rope` -- RMSNorm and rotate-half RoPE in one Triton launch each (:func:`~.norm_rope.rms_norm_triton`,
  :func:`~.norm_rope.apply_rope_triton`; references :func:`~.norm_rope.rms_norm_torch`,
  :func:`~.norm_rope.apply_rope_torch`), which ``model.layers`` takes on CUDA.
* :mod:`.score_head` -- the scoring head's log p(target) and greedy flag in one pass over a chunk's model-dtype logits
  (:func:`~.score_head.score_head_triton`; reference :func:`~.score_head.score_head_torch`), which
  ``pipeline.token_scores`` takes on CUDA.
"""

from .fused_moe import (
    REFERENCE_ORDERS,
    MoEAlignment,
    MoEKernelConfig,
    default_kernel_config,
    experts_ffn_hf_grouped,
    experts_ffn_reference,
    experts_ffn_reference_from,
    fused_experts_triton,
    fused_moe_workspace_bytes,
    moe_align,
    triton_available,
)
from .mxfp4 import (
    MXFP4PageLayout,
    experts_ffn_mxfp4_reference,
    fused_experts_mxfp4_triton,
    mxfp4_dequantize,
    mxfp4_expert_bytes,
    mxfp4_page_layout,
    pack_mxfp4_pages,
    unpack_mxfp4_page,
)
from .pages import PageEntry, PageLayout
from .quant import (
    PAGE_SCHEMES,
    ExpertPageLayout,
    PageScheme,
    QuantTensor,
    analytic_error_bound,
    dense_expert_scratch,
    dequantize,
    dequantize_pages_triton,
    dequantize_triton,
    expert_tensor_specs,
    experts_ffn_qt_reference,
    fused_experts_quant_triton,
    quant_tensors_from_views,
    expert_page_layout,
    experts_ffn_quant_reference,
    fused_experts_paged_triton,
    pack_expert_page,
    pack_expert_pages,
    page_quant_tensors,
    page_weight_views,
    quant_error_bound,
    quantize_groupwise,
    unpack_expert_page,
)

__all__ = [
    "ExpertPageLayout", "MoEAlignment", "MoEKernelConfig", "PAGE_SCHEMES", "PageEntry", "PageLayout", "PageScheme",
    "QuantTensor", "REFERENCE_ORDERS", "analytic_error_bound", "default_kernel_config", "dequantize",
    "expert_page_layout", "experts_ffn_hf_grouped", "experts_ffn_quant_reference", "experts_ffn_reference",
    "experts_ffn_reference_from", "fused_experts_paged_triton", "fused_experts_triton",
    "fused_moe_workspace_bytes", "moe_align", "pack_expert_page", "pack_expert_pages", "page_quant_tensors",
    "page_weight_views", "quant_error_bound", "quantize_groupwise", "triton_available", "unpack_expert_page",
    "expert_tensor_specs", "experts_ffn_qt_reference", "fused_experts_quant_triton", "quant_tensors_from_views",
    "dense_expert_scratch", "dequantize_pages_triton", "dequantize_triton",
    "MXFP4PageLayout", "experts_ffn_mxfp4_reference", "fused_experts_mxfp4_triton", "mxfp4_dequantize",
    "mxfp4_expert_bytes", "mxfp4_page_layout", "pack_mxfp4_pages", "unpack_mxfp4_page",
]
