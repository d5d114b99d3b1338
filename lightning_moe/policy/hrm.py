"""The Hierarchical Roofline Model (HRM): bytes and FLOPs -> seconds per stage, and peak memory.

Sources: MoE-Lightning (Cao et al., arXiv 2411.11217), Sec. 3 (the HRM: a roofline per memory level plus
cross-level "memory roofs" for the links between levels) and Sec. 4 (CGOPipe's overlap of CPU attention,
GPU compute and PCIe transfers; the policy-search cost model); DESIGN.md "The hierarchical roofline
model". Equation numbers below are ours (H1..H9); the paper's own numbering could not be checked
against its text here, so "Sec." citations are the reliable ones.

  (H1) stage cost on level i with data from level j:  t = max(FLOPs / P_i, bytes_i / B_i, bytes_{j->i} / B_{j,i})
  (H2) decode layer:   T_layer = max(T_h2d, T_d2h, T_cpu, T_gpu, T_host)   (CGOPipe overlaps the five streams)
  (H3) T_h2d = (experts of the layer not resident on the GPU) * expert_bytes / B_h2d
               + CPU-attention outputs  (n - n_g) * mu * attn_output_elems * itemsize / B_h2d
  (H4) T_d2h = (n - n_g) * mu * (attn_query_elems + kv_elems_per_token) * itemsize / B_d2h
  (H5) T_cpu = max(S_c * c * attn_flops_per_position / P_cpu_attn, S_c * c * kv_elems * itemsize / B_cpu_attn),
               S_c = (n - n_g) * mu sequences on the CPU, c = attended positions of the CPU rows: the mean
               context + Workload.attention_context_offsets (the executor puts the shortest micro-batches on
               the GPU, so with 0 < n_g < n the CPU rows are the longest; GPU attention likewise at its offset)
  (H6) T_gpu = n * [qkv + o_proj + router + experts + shared] (each (H1) on the GPU for mu tokens)
               + n_g * attention(mu, c) on the GPU;  experts read E * (1 - (1 - k/E)^T) distinct experts
               + T_deq: quantized experts are dequantized once per layer visit, all E of the layer (paged and
               resident), memory-bound: E (packed + dense expert bytes) / B_gpu; the experts' FLOP rate is the
               profile's measured rate for the expert shape at T tokens per call (expert_ffn_rates, the faster of
               the Triton and grouped_mm kernels, log-T interpolated), else gpu_expert_flops, capped by the peak
  (H6') T_host = (n - n_g) h_c + n_g h_g [+ one CPU micro-batch's attention when n - n_g >= 1]: the host thread
               issues every micro-batch's work (h_c, h_g: measured by running CGOPipe's own decode on a tiny model: the
               profile's host_issue_by_family entry of the job's family and expert format where measured, else the
               generic probe's host_issue_cpu_attn / _gpu_attn; host_issue_times) and, having nothing left to issue, waits for the
               layer's last CPU attention; 0 when the profile has no host measurement (the host's issue time is
               accounted for by no other stage)
  (H5') host DRAM shared by CPU attention and page DMA, where the profile measured the two running at once (rates
               c' of the attention's KV and h' of pinned H2D, against c = B_cpu_attn and h = B_h2d alone; p = c'/c and
               q = h'/h each at most 1): no schedule of the two beats the convex hull of (c, 0), (0, h), (c', h')
               (the measured points, and time-sharing between them), so a layer that reads X = S_c kv bytes / c
               seconds of KV and pages Y = T_h2d seconds takes at least X + a Y and Y + b X, a = min(1, (1 - p) / q),
               b = min(1, (1 - q) / p) (dram_sharing); T_cpu >= X + a Y and T_h2d >= Y + b X. Where p + q < 1 the
               clamp gives X + Y, looser than running them overlapped would take (a bound, not tight; the clamp also
               keeps the MILP's layer classes exact: a <= 1). No contention (p = q = 1): a = b = 0, the stages are
               (H3)-(H5) as they were; no measurement: no rows. With g GPUs (H10) X is x g but Y one link's: the
               point was measured on one link, so g links paging at once are understated
  (H7) decode step: sum over layers of (H2) + n * head(mu);  T_decode = sum over steps j = 1..G-1
               with c = prompt_len + j (the first token comes from prefill)
  (H8) prefill: per layer max(T_h2d (experts only), T_d2h (prompt KV of CPU-KV sequences), T_gpu =
               sum over prefill micro-batches of (H1) kernels incl. causal attention and the MoE layer's
               measured element-wise traffic + T_deq for quantized pages), + head for the last token of each
               sequence
  (H9) throughput: prefill N * prompt_len / T_prefill; decode N * (G - 1) / T_decode;
               end-to-end N * G / (T_prefill + T_decode)  (the planner's objective)
  (H10) g GPUs of one host (Policy.gpus, expert parallelism; g = 1 is everything above, bit for bit): expert e of
               each layer lives on GPU e % g (resident experts are 0..r-1 of a layer, so a GPU holds at most
               ceil(r / g) of them and pages at most ceil((E - r) / g)); each GPU pages its share over its own PCIe
               link: T_h2d's expert term is ceil((E - r) / g) expert_bytes / B_h2d. Attention, the dense parts and the
               shared experts run replicated (data-identical) on every GPU; each GPU computes its experts' share of the
               routed FFN (the experts term / g; dequantization of ceil(E / g) experts) and the per-layer token
               exchange is an all-reduce (sum) of the routed experts' fp32 slot outputs [T, k, D] over the
               GPU-to-GPU link (ring: 2 (g - 1) / g of the bytes per GPU, HardwareProfile.gpu_link), on the GPU
               stream. Every process runs its own CPU attention over the same CPU rows on one shared host: T_cpu x g,
               and the host holds g CPU KV caches, g staging buffers and g process reserves (the pinned expert pool
               once: each process pins its own experts). Memory per GPU: the non-expert weights, its resident
               experts, two page buffers of ceil((E - r) / g) experts.

Memory (real byte counts, DESIGN.md): GPU = non-expert weights + resident experts + 2 page buffers (each
the largest non-resident set of one layer) + for quantized pages a dense scratch of one layer's E experts
(CGOPipe's dequantized experts, in the compute dtype) + GPU KV at full length + activations/workspaces
(decode: N hidden rows + 2 micro-batch workspaces; prefill: N * max_prompt hidden rows + one prefill
micro-batch workspace) + allocator reserve; CPU = pinned non-resident experts + CPU KV for its sequences at full
length + pinned staging + reserve. Quantized experts change expert_bytes and add the dequantization
scratch and time (T_deq); the other formulas are the same.

Modelling choices (stated so a measured run can be compared): routing is uniform (no routing traces);
prefill attention is a fused kernel (no S^2 score matrix in memory); element-wise kernels (norms, RoPE,
SiLU) are folded into the GEMMs' activation bytes, except in a prefill MoE layer when the profile measured their
traffic (``prefill_elementwise_rows``: :func:`gpu_prefill_elementwise_time`); CPU attention threads do not slow the
GPU feeder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from ..model.spec import QUANT_FORMATS, MoESpec, dtype_bytes
from .batching import KV_GROUPS, SCORE_CHUNK_TOKENS
from .hardware import EXPERT_FFN_KERNELS, NO_SYNC_KERNELS, HardwareProfile, format_bytes
from .policy import LIBRARY_WORKSPACE, PlanInfeasible, Policy, Workload

STAGES = ("h2d", "d2h", "cpu", "gpu", "host")  # the overlapped streams of one layer (H2)


def roofline(flops: float, nbytes: float, peak_flops: float, bandwidth: float,
             link_bytes: float = 0.0, link_bandwidth: float = math.inf) -> float:
    """(H1) Seconds of one stage: max(FLOPs / P_i, bytes_i / B_i, bytes_{j->i} / B_{j,i}).

    MoE-Lightning Sec. 3 (HRM: compute roof, memory roof of level i, cross-level memory roof).
    flops in FLOP, nbytes/link_bytes in bytes, peak_flops in FLOP/s, bandwidths in bytes/s.
    """
    t = max(flops / peak_flops, nbytes / bandwidth)
    if link_bytes:
        t = max(t, link_bytes / link_bandwidth)
    return t


def active_experts(tokens: float, num_experts: int, top_k: int) -> float:
    """Expected distinct experts hit by ``tokens`` tokens under uniform top-k routing: E * (1 - (1 - k/E)^T)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


# ---- GPU kernels of one micro-batch (each an (H1) roofline on the GPU) ------------------------------
def _gpu(hw: HardwareProfile, dtype: str) -> tuple[float, float]:
    return hw.gpu_flops(dtype), hw.gpu_hbm_bandwidth


def gpu_qkv_time(spec: MoESpec, hw: HardwareProfile, tokens: float, dtype: str = "bf16") -> float:
    """Pre-attention projections for ``tokens`` tokens: FLOPs 2 T P_in; bytes P_in b + T (D + q + kv) b.

    P_in = spec.attn_in_params (wq, wk, wv or MLA's q/kv_a/kv_b), q = attn_query_elems, kv = kv_elems_per_token.
    """
    b = dtype_bytes(dtype)
    P, B = _gpu(hw, dtype)
    p = spec.attn_in_params
    return roofline(2 * tokens * p, p * b + tokens * (spec.hidden_size + spec.attn_query_elems + spec.kv_elems_per_token) * b, P, B)


def gpu_o_proj_time(spec: MoESpec, hw: HardwareProfile, tokens: float, dtype: str = "bf16") -> float:
    """Output projection: FLOPs 2 T P_o; bytes P_o b + T (attn_output_elems + D) b."""
    b = dtype_bytes(dtype)
    P, B = _gpu(hw, dtype)
    p = spec.attn_out_params
    return roofline(2 * tokens * p, p * b + tokens * (spec.attn_output_elems + spec.hidden_size) * b, P, B)


def gpu_router_time(spec: MoESpec, hw: HardwareProfile, tokens: float, dtype: str = "bf16") -> float:
    """Router logits: FLOPs 2 T E D; bytes E D b + T D b + T E 4 (fp32 logits)."""
    b = dtype_bytes(dtype)
    P, B = _gpu(hw, dtype)
    E, D = spec.num_experts, spec.hidden_size
    return roofline(2 * tokens * E * D, E * D * b + tokens * D * b + tokens * E * 4, P, B)


def gpu_experts_time(spec: MoESpec, hw: HardwareProfile, tokens: float, dtype: str = "bf16", quant: str = "bf16",
                     prefill: bool = False) -> float:
    """Routed experts (fused MoE): FLOPs 2 T k 3 D F; bytes active_experts(T) * expert_bytes(quant) + T k 2 D b.

    The FLOP rate, capped by the dtype's GEMM peak: the profile's measured rate of the fastest expert-FFN kernel
    CGOPipe may run for this expert shape (D, F, E, k) and dtype at ``tokens`` tokens per call (``prefill``: any of
    EXPERT_FFN_KERNELS; a decode step: the NO_SYNC_KERNELS) (:meth:`HardwareProfile.expert_ffn_rate`:
    ``expert_ffn_rates``, log-T interpolated between measured buckets; MXFP4 pages, ``quant`` "mxfp4": the MXFP4
    kernel's entries, ``weights: mxfp4``), where the profile has that shape; else its
    ``gpu_expert_flops`` (the grouped Triton kernel's rate at one prefill size) when measured; else the GEMM peak
    (optimistic: the grouped kernels run below the cuBLAS peak).
    """
    b = dtype_bytes(dtype)
    P, B = _gpu(hw, dtype)
    mx = quant == "mxfp4"  # MXFP4 pages: the MXFP4 Triton kernel's own measured rate, where the profile has it
    rate = hw.expert_ffn_rate(spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k, dtype, tokens,
                              ("triton",) if mx else EXPERT_FFN_KERNELS if prefill else NO_SYNC_KERNELS,
                              "mxfp4" if mx else "dense")
    if rate > 0:
        P = min(P, rate)
    elif hw.gpu_expert_flops > 0:
        P = min(P, hw.gpu_expert_flops)
    k = spec.top_k
    nbytes = active_experts(tokens, spec.num_experts, k) * spec.expert_bytes(quant) + tokens * k * 2 * spec.hidden_size * b
    return roofline(2 * tokens * k * spec.expert_params, nbytes, P, B)


def gpu_dequant_time(spec: MoESpec, hw: HardwareProfile, non_resident: float, quant: str, dtype: str = "bf16") -> float:
    """T_deq: dequantizing ``non_resident`` paged experts of one layer once (memory-bound, no FLOP term):
    non_resident * (expert_bytes(quant) read + expert_bytes(dtype) written) / B_gpu, in seconds;
    0 for unquantized pages (``quant`` not in QUANT_FORMATS), which need no dequantization."""
    if quant not in QUANT_FORMATS:
        return 0.0
    return non_resident * (spec.expert_bytes(quant) + spec.expert_bytes(dtype)) / hw.gpu_hbm_bandwidth


def gpu_shared_experts_time(spec: MoESpec, hw: HardwareProfile, tokens: float, dtype: str = "bf16") -> float:
    """Shared experts (0 if none): FLOPs 2 T P_s; bytes P_s b + T 2 D b."""
    p = spec.shared_expert_params
    if not p:
        return 0.0
    b = dtype_bytes(dtype)
    P, B = _gpu(hw, dtype)
    return roofline(2 * tokens * p, p * b + tokens * 2 * spec.hidden_size * b, P, B)


def gpu_dense_ffn_time(spec: MoESpec, hw: HardwareProfile, tokens: float, dtype: str = "bf16") -> float:
    """Dense FFN of a dense layer: FLOPs 2 T 3 D F_d; bytes 3 D F_d b + T 2 D b."""
    p = spec.dense_ffn_params
    b = dtype_bytes(dtype)
    P, B = _gpu(hw, dtype)
    return roofline(2 * tokens * p, p * b + tokens * 2 * spec.hidden_size * b, P, B)


def token_exchange_time(spec: MoESpec, hw: HardwareProfile, tokens: float, gpus: int = 1) -> float:
    """(H10) The per-layer token exchange of ``gpus`` expert-parallel GPUs for ``tokens`` tokens: a ring all-reduce
    (sum) of the routed experts' fp32 slot outputs [T, k, D] (each slot non-zero on the one GPU holding its expert,
    so the sum is exact), 2 (g - 1) / g * T k D 4 bytes per GPU over ``hw.gpu_link_bandwidth``; 0 for one GPU."""
    if gpus <= 1:
        return 0.0
    return 2 * (gpus - 1) / gpus * tokens * spec.top_k * spec.hidden_size * 4 / hw.gpu_link_bandwidth


def paged_per_gpu(non_resident: int, gpus: int = 1) -> int:
    """(H10) Paged experts of one layer on the busiest of ``gpus`` GPUs (expert e on GPU e % g): ceil(non_resident / g).
    The same bound holds for a layer's resident experts."""
    return -(-non_resident // gpus)


def gpu_layer_time(spec: MoESpec, hw: HardwareProfile, tokens: float, dense: bool, dtype: str = "bf16", quant: str = "bf16",
                   gpus: int = 1, prefill: bool = False) -> float:
    """GPU time of one layer for one micro-batch of ``tokens`` tokens, attention itself excluded.

    MoE layer: qkv + o_proj + router + experts + shared; dense layer: qkv + o_proj + dense FFN; plus the
    profile's fixed ``microbatch_overhead`` (host issue cost of one micro-batch's kernels): at decode sizes
    the kernels are tiny and the GPU stream runs no faster than the host issues them, which the
    roofline terms alone would miss (it is what makes many small micro-batches slow). With ``gpus`` > 1 (H10):
    the experts term / g on each GPU, + the token exchange (:func:`token_exchange_time`). ``prefill``: a prefill
    pass's micro-batch (its expert kernels: :func:`gpu_experts_time`).
    """
    t = hw.microbatch_overhead + gpu_qkv_time(spec, hw, tokens, dtype) + gpu_o_proj_time(spec, hw, tokens, dtype)
    if dense:
        return t + gpu_dense_ffn_time(spec, hw, tokens, dtype)
    return (t + gpu_router_time(spec, hw, tokens, dtype) + gpu_experts_time(spec, hw, tokens, dtype, quant, prefill) / gpus
            + gpu_shared_experts_time(spec, hw, tokens, dtype) + token_exchange_time(spec, hw, tokens, gpus))


def gpu_decode_attention_time(spec: MoESpec, hw: HardwareProfile, seqs: float, context: float, dtype: str = "bf16") -> float:
    """GPU decode attention of ``seqs`` sequences over ``context`` positions (one layer).

    FLOPs S c attn_flops_per_position; bytes S (c kv + q + out + kv) b (read KV, q; write out, new kv). MLA runs the
    torch ``latent_attention`` (no fused kernel), and its bytes per position are what that moves: the latents read in
    the dtype and copied to fp32 for the scores (kv (b + 4 + 4)), their first kv_lora read again and copied to fp32
    for the values (kv_lora (b + 4 + 4)), and the fp32 scores written, masked, softmaxed and read (6 x 4 Hq).
    """
    b = dtype_bytes(dtype)
    P, B = _gpu(hw, dtype)
    kv = spec.kv_elems_per_token
    per_pos = (kv * (b + 8) + spec.kv_lora_rank * (b + 8) + 24 * spec.num_heads) if spec.is_mla else kv * b
    return roofline(seqs * context * spec.attn_flops_per_position,
                    seqs * (context * per_pos + (spec.attn_query_elems + spec.attn_output_elems + kv) * b), P, B)


def prefill_attended(prompt_len: float, window: "int | None" = None) -> float:
    """Query-key pairs of causal attention over a prompt of ``prompt_len`` tokens: s (s + 1) / 2, or with a sliding
    window W < s (each token sees at most the last W): W (W + 1) / 2 + (s - W) W (the fused kernels skip the key
    blocks before a query block's window)."""
    s = prompt_len
    if window is None or s <= window:
        return s * (s + 1) / 2
    return window * (window + 1) / 2 + (s - window) * window


def gpu_prefill_attention_time(spec: MoESpec, hw: HardwareProfile, seqs: float, prompt_len: float, dtype: str = "bf16",
                               window: "int | None" = None) -> float:
    """Causal prefill attention (fused kernel) of ``seqs`` prompts of ``prompt_len`` tokens (one layer; ``window``:
    the layer's sliding window, None for full attention).

    FLOPs S * :func:`prefill_attended` * prefill_attn_flops_per_position; bytes S s (q_size + kv + Hq v_hd) b.
    """
    b = dtype_bytes(dtype)
    P, B = _gpu(hw, dtype)
    s = prompt_len
    flops = seqs * prefill_attended(s, window) * spec.prefill_attn_flops_per_position
    nbytes = seqs * s * (spec.q_size + spec.kv_elems_per_token + spec.num_heads * spec.value_head_dim) * b
    return roofline(flops, nbytes, P, B)


def gpu_prefill_elementwise_time(spec: MoESpec, hw: HardwareProfile, tokens: float, dtype: str = "bf16") -> float:
    """The element-wise kernels of ``tokens`` prefill tokens through one MoE layer that the roofline terms leave out:
    bytes T * prefill_elementwise_rows * D b at the HBM bandwidth (the profile's measured traffic; 0 when
    unmeasured)."""
    return tokens * hw.prefill_elementwise_rows * spec.hidden_size * dtype_bytes(dtype) / hw.gpu_hbm_bandwidth


def gpu_head_time(spec: MoESpec, hw: HardwareProfile, rows: float, tokens: float, dtype: str = "bf16") -> float:
    """Embedding of ``tokens`` tokens + final norm and lm_head for ``rows`` rows.

    FLOPs 2 rows D V; bytes V D b + rows V 4 (fp32 logits) + 2 tokens D b (embedding read + write).
    """
    b = dtype_bytes(dtype)
    P, B = _gpu(hw, dtype)
    D, V = spec.hidden_size, spec.vocab_size
    return roofline(2 * rows * D * V, V * D * b + rows * V * 4 + 2 * tokens * D * b, P, B)


def cpu_decode_attention_time(spec: MoESpec, hw: HardwareProfile, seqs: float, context: float, dtype: str = "bf16") -> float:
    """(H5) CPU decode attention of ``seqs`` sequences over ``context`` positions (one layer).

    max(S c attn_flops_per_position / P_cpu_attn, S c kv_elems b / B_cpu_attn): the CPU attention routine's
    measured FLOP/s and KV streaming bytes/s (HardwareProfile.cpu_attention_*); an MLA model's FLOP rate is the
    latent kernel's (``cpu_latent_attention_flops``, when measured).
    """
    flops = hw.cpu_latent_attention_flops if spec.is_mla and hw.cpu_latent_attention_flops > 0 else hw.cpu_attention_flops
    return max(seqs * context * spec.attn_flops_per_position / flops,
               cpu_attention_kv_time(spec, hw, seqs, context, dtype))


def cpu_attention_kv_rate(spec: MoESpec, hw: HardwareProfile, dtype: str = "bf16") -> float:
    """Bytes of valid KV per second that (H5) allows this model's CPU attention: the KV bandwidth, or lower where the
    FLOP term binds (attn_flops_per_position FLOPs per position at the profile's CPU attention FLOP rate)."""
    kv, attn = cpu_attention_kv_time(spec, hw, 1.0, 1.0, dtype), cpu_decode_attention_time(spec, hw, 1.0, 1.0, dtype)
    return hw.cpu_attention_bandwidth * kv / attn  # the seconds of one position's KV bytes over (H5)'s seconds


def cpu_attention_kv_time(spec: MoESpec, hw: HardwareProfile, seqs: float, context: float, dtype: str = "bf16") -> float:
    """(H5') X: the KV bytes of (H5) alone, S c kv_elems b / B_cpu_attn (the part of CPU attention that reads DRAM)."""
    return seqs * context * spec.kv_elems_per_token * dtype_bytes(dtype) / hw.cpu_attention_bandwidth


def dram_sharing(hw: HardwareProfile) -> "tuple[float, float] | None":
    """(H5') (a, b): seconds CPU attention loses per second of page DMA beside it, and page DMA per second of CPU
    attention, from the profile's one measured point of both at once (``cpu_attention_bandwidth_under_h2d``,
    ``pcie_h2d_under_cpu_attention``); each in [0, 1] (1: no overlap at all, the hull is the triangle). None when the
    profile has not measured that point (then the HRM has no sharing rows)."""
    c_under, h_under = hw.cpu_attention_bandwidth_under_h2d, hw.pcie_h2d_under_cpu_attention
    if c_under <= 0 or h_under <= 0:
        return None
    rc, rh = min(1.0, c_under / hw.cpu_attention_bandwidth), min(1.0, h_under / hw.pcie_h2d)
    return min(1.0, (1 - rc) / rh), min(1.0, (1 - rh) / rc)


def decode_d2h_time(spec: MoESpec, hw: HardwareProfile, seqs: float, dtype: str = "bf16") -> float:
    """(H4) Device-to-host bytes of CPU-attention sequences per layer: S (q + new kv) b / B_d2h."""
    return seqs * (spec.attn_query_elems + spec.kv_elems_per_token) * dtype_bytes(dtype) / hw.pcie_d2h


def decode_h2d_act_time(spec: MoESpec, hw: HardwareProfile, seqs: float, dtype: str = "bf16") -> float:
    """(H3, second term) Host-to-device attention outputs of CPU-attention sequences: S out b / B_h2d."""
    return seqs * spec.attn_output_elems * dtype_bytes(dtype) / hw.pcie_h2d


def expert_h2d_time(spec: MoESpec, hw: HardwareProfile, non_resident: int, quant: str = "bf16") -> float:
    """(H3, first term) Paging ``non_resident`` experts of one layer: non_resident * expert_bytes / B_h2d."""
    return non_resident * spec.expert_bytes(quant) / hw.pcie_h2d


def prefill_d2h_time(spec: MoESpec, hw: HardwareProfile, seqs: float, prompt_len: float, dtype: str = "bf16") -> float:
    """Prefill KV of CPU-KV sequences shipped to the host per layer: S s kv b / B_d2h."""
    return seqs * prompt_len * spec.kv_elems_per_token * dtype_bytes(dtype) / hw.pcie_d2h


# ---- per-layer stage times ------------------------------------------------------------------------
@dataclass(frozen=True)
class StageTimes:
    """Seconds of the five overlapped streams of one layer (H2)."""

    h2d: float  # PCIe host->device: expert pages + attention outputs
    d2h: float  # PCIe device->host: q/k/v of CPU-attention sequences (prefill: their prompt KV)
    cpu: float  # CPU decode attention
    gpu: float  # GPU kernels of all micro-batches
    host: float = 0.0  # the host thread issuing the micro-batches' work (H6'); 0 without a host measurement

    @property
    def time(self) -> float:
        """Layer time: max of the five (CGOPipe overlaps them)."""
        return max(self.h2d, self.d2h, self.cpu, self.gpu, self.host)

    @property
    def binding(self) -> str:
        """Name of the slowest stream."""
        return max(STAGES, key=lambda s: getattr(self, s))


def prefill_micro_batches(N: int, prefill_mu: int) -> list[tuple[int, int]]:
    """Prefill micro-batches as (count, size): N // prefill_mu of prefill_mu, plus one of the remainder."""
    full, rem = divmod(N, prefill_mu)
    out = [(full, prefill_mu)] if full else []
    if rem:
        out.append((1, rem))
    return out


def pass_prefill_chunks(policy: Policy, rows: int | None = None) -> list[tuple[int, int]]:
    """A prefill pass's micro-batches as (count, size). The first fill (``rows`` None) is cut per decode micro-batch,
    as the executor's ``prefill_chunks`` cuts it: n x (mu // prefill_mu of prefill_mu, one of the remainder); a
    refill's pass of ``rows`` sequences: :func:`prefill_micro_batches` of its rows."""
    if rows is not None:
        return prefill_micro_batches(rows, policy.prefill_mu)
    return [(policy.n * count, size) for count, size in prefill_micro_batches(policy.mu, policy.prefill_mu)]


def cpu_attention_calls(mu: int) -> int:
    """CPU decode-attention calls per CPU micro-batch of ``mu`` rows and layer: one per KV length group of its
    GroupedKVCache, at most min(KV_GROUPS, mu) (fewer only when the micro-batch has fewer distinct lengths)."""
    return min(KV_GROUPS, mu)


def cpu_attended(spec: MoESpec, layer: int, context: float) -> float:
    """Positions one CPU decode attention row of decoder layer ``layer`` reads at ``context`` cached positions: the
    native kernel reads only the last ``sliding_window`` of them in a windowed layer (``MoESpec.layer_sliding_window``),
    all of them elsewhere. At a mean context this is min(mean, window), which is at least the mean of the rows' own
    min(length, window) (min is concave): where the rows' lengths straddle the window the term charges more than they
    read, so it is not a strict bound there (the whole context, charged before, was further from one)."""
    window = spec.layer_sliding_window(layer)
    return context if window is None else min(context, float(window))


def decode_layer_times(spec: MoESpec, hw: HardwareProfile, policy: Policy, layer: int, non_resident: int, context: float,
                       cpu_offset: float = 0.0, gpu_offset: float = 0.0) -> StageTimes:
    """(H2)-(H6) one decode layer at ``context`` attended positions, for ``non_resident`` paged experts.

    ``cpu_offset`` / ``gpu_offset``: positions added to ``context`` for the CPU / GPU attention rows
    (Workload.attention_context_offsets: the executor gives the shortest micro-batches GPU attention, so the
    CPU rows are longer than the mean when 0 < n_gpu_attn < n).

    The CPU stage is one attention call per KV length group of each CPU micro-batch (:func:`cpu_attention_calls`):
    n_cpu * calls(mu) * cpu_attention_overhead + (H5) of all CPU sequences (the overhead term is what makes
    many small micro-batches slow on the CPU side). (H5) at the mean context: the grouped caches read each
    group only up to its own longest row. Quantized pages add T_deq (:func:`gpu_dequant_time`: all E experts
    of the layer, once per layer visit) to the GPU stage.
    When some attention runs on the CPU, a CPU micro-batch's attention of layer l+1 waits for its own GPU work of
    layer l (post-attention, then the next pre-attention), so a layer takes at least c_1 + g_1 (c_1, g_1: one
    micro-batch's CPU attention and GPU layer time): the CPU stage is max(C, c_1 + g_1). With n = 1 this is G + C,
    no overlap, which is what the executor does. With several micro-batches the executor's look-ahead
    (``CGOPipeOptions.layer_lookahead``) queues each micro-batch's next-layer attention behind the others, so no
    other fill is paid per layer (before session 45 the HRM charged max(G + c_1, C + g_1), the schedule without
    it). Where the profile measured CPU attention beside pinned copies, (H5') raises the CPU and H2D stages
    (:func:`dram_sharing`). In a sliding-window layer the CPU rows attend over :func:`cpu_attended` positions (the
    native kernel reads the window only); GPU attention is priced over the whole context (the default "torch" GPU
    attention reads every cached position of its length group and masks).
    """
    dt, q, g = policy.dtype, policy.weight_quant, policy.gpus
    dense = spec.is_dense_layer(layer)
    cpu_seqs = policy.n_cpu_attn * policy.mu
    h2d = ((0.0 if dense else expert_h2d_time(spec, hw, paged_per_gpu(non_resident, g), q))
           + decode_h2d_act_time(spec, hw, cpu_seqs, dt))
    gpu_mb = gpu_layer_time(spec, hw, policy.mu, dense, dt, q, g)  # one micro-batch, attention excluded
    gpu = policy.n * gpu_mb + policy.n_gpu_attn * gpu_decode_attention_time(spec, hw, policy.mu, context + gpu_offset, dt)
    if not dense and q in QUANT_FORMATS:  # all E experts (this GPU's share: H10) dequantized once per layer visit
        gpu += gpu_dequant_time(spec, hw, paged_per_gpu(spec.num_experts, g), q, dt)
    call = cpu_attention_calls(policy.mu) * hw.cpu_attention_overhead  # fixed cost of one CPU micro-batch
    cc = cpu_attended(spec, layer, context + cpu_offset)  # positions a CPU row reads (the window, if any)
    # (H10) every process attends over the same CPU rows on one shared host: x g
    cpu = (policy.n_cpu_attn * call + cpu_decode_attention_time(spec, hw, cpu_seqs, cc, dt)) * g
    host = decode_host_issue_time(hw, policy, spec)
    if policy.n_cpu_attn:  # one CPU micro-batch's round trip: its next-layer attention waits for its own GPU layer
        cpu_mb = (call + cpu_decode_attention_time(spec, hw, policy.mu, cc, dt)) * g
        cpu = max(cpu, cpu_mb + gpu_mb)  # (the MILP's chain row)
    shared = dram_sharing(hw)  # (H5'): the attention's KV reads and the layer's H2D copies
    if shared and cpu_seqs:  # share host DRAM
        kv = cpu_attention_kv_time(spec, hw, cpu_seqs, cc, dt) * g
        cpu, h2d = max(cpu, kv + shared[0] * h2d), h2d + shared[1] * kv
    return StageTimes(h2d=h2d, d2h=decode_d2h_time(spec, hw, cpu_seqs, dt), cpu=cpu, gpu=gpu, host=host)


NO_HOST_STAGE_NOTE = ("note: hardware {hw} has no host issue times (host_issue_cpu_attn, host_issue_gpu_attn; presets carry "
                      "none), so decode has no host stage and is predicted too fast where the host binds (small models, "
                      "many micro-batches); `moe-batch profile` measures them")


NO_DRAM_SHARING_NOTE = ("note: hardware {hw} has no measured point of CPU attention beside pinned H2D copies "
                        "(cpu_attention_bandwidth_under_h2d, pcie_h2d_under_cpu_attention: a profile older than the "
                        "fields, or their probe failed), so its CPU attention is priced as if page DMA took no host "
                        "DRAM bandwidth; `moe-batch profile` measures it")


def has_host_stage(hw: HardwareProfile) -> bool:
    """Whether the profile measured the host's issue time (H6'): without it the decode host stage is 0."""
    return hw.host_issue_cpu_attn > 0 or hw.host_issue_gpu_attn > 0


def decode_host_issue_time(hw: HardwareProfile, policy: Policy, spec: MoESpec) -> float:
    """(H6') without the wait: seconds the host thread spends issuing one decode layer's work, (n - n_g) h_c + n_g h_g
    (the job's host probe: :func:`host_issue_times`); 0 when the profile has no host measurement."""
    h_c, h_g = host_issue_times(hw, spec, policy.weight_quant)
    return policy.n_cpu_attn * h_c + policy.n_gpu_attn * h_g


def host_issue_times(hw: HardwareProfile, spec: MoESpec, weight_quant: str) -> tuple[float, float]:
    """(h_c, h_g) of (H6') for ``spec`` with ``weight_quant`` expert pages: the profile's host probe of the job's
    family and expert format where measured, else its family's dense probe, else the MLA probe for an MLA model, else
    the generic one (HardwareProfile.host_issue_for; :func:`host_probe` names which)."""
    return hw.host_issue_for(spec.model_type, weight_quant, spec.is_mla)[1:]


def host_probe(hw: HardwareProfile, spec: MoESpec, weight_quant: str) -> str:
    """The host probe that prices (H6') for this job ("qwen3_moe", "mixtral/int4", "mla", "generic"; the report's
    ``predicted.host_probe``); "" when the profile has no host measurement (no host stage)."""
    probe, h_c, h_g = hw.host_issue_for(spec.model_type, weight_quant, spec.is_mla)
    return probe if h_c > 0 or h_g > 0 else ""  # the MILP's host row has the same test (_host_row)


def prefill_layer_times(spec: MoESpec, hw: HardwareProfile, policy: Policy, layer: int, non_resident: int, prompt_len: float,
                        rows: int | None = None, cpu_rows: float | None = None) -> StageTimes:
    """(H8) one prefill layer: experts paged the same way, attention on the GPU per prefill micro-batch; quantized
    pages add T_deq once (CGOPipe dequantizes the layer's experts on the visit's first FFN call and reuses the dense
    experts for the rest of the layer visit). ``rows`` / ``cpu_rows``: the sequences prefilled / those of them with
    CPU KV (default: the policy's N / its CPU-attention micro-batches' rows; a refill's pass fills fewer)."""
    dt, q, g = policy.dtype, policy.weight_quant, policy.gpus
    dense = spec.is_dense_layer(layer)
    gpu = 0.0
    cpu_rows = policy.n_cpu_attn * policy.mu if cpu_rows is None else cpu_rows
    mbs = pass_prefill_chunks(policy, rows)
    for count, size in mbs:
        tokens = size * prompt_len
        gpu += count * (gpu_layer_time(spec, hw, tokens, dense, dt, q, g, prefill=True)
                        + gpu_prefill_attention_time(spec, hw, size, prompt_len, dt, spec.layer_sliding_window(layer))
                        + (0.0 if dense else gpu_prefill_elementwise_time(spec, hw, tokens, dt)))
    if not dense and mbs and q in QUANT_FORMATS:  # all E experts (this GPU's share: H10) dequantized once per layer visit
        gpu += gpu_dequant_time(spec, hw, paged_per_gpu(spec.num_experts, g), q, dt)
    h2d = 0.0 if dense else expert_h2d_time(spec, hw, paged_per_gpu(non_resident, g), q)
    return StageTimes(h2d=h2d, d2h=prefill_d2h_time(spec, hw, cpu_rows, prompt_len, dt), cpu=0.0, gpu=gpu)


def decode_head_time(spec: MoESpec, hw: HardwareProfile, policy: Policy) -> float:
    """Per decode step, not overlapped: n * head(mu rows, mu tokens) (embedding, final norm, lm_head)."""
    return policy.n * gpu_head_time(spec, hw, policy.mu, policy.mu, policy.dtype)


def prefill_head_time(spec: MoESpec, hw: HardwareProfile, policy: Policy, prompt_len: float,
                      all_tokens: bool = False, rows: int | None = None) -> float:
    """Prefill, not overlapped: per prefill micro-batch, embedding of its tokens and lm_head of its last tokens (of
    every token with ``all_tokens``: scoring); ``rows``: the sequences prefilled (default the policy's N)."""
    return sum(count * gpu_head_time(spec, hw, size * (prompt_len if all_tokens else 1), size * prompt_len, policy.dtype)
               for count, size in pass_prefill_chunks(policy, rows))


# ---- memory --------------------------------------------------------------------------------------
FRAGMENTATION = 0.5  # budgeted caching-allocator slack per byte of a phase's transient workspaces (cached blocks of
# other chunk sizes); budgeted, not in the allocated peak
FFN_SPARE_ROWS = 32  # padding rows of the per-expert GEMM loop's buffers (kernels.fused_moe.MM_LOOP_TILE)
MAX_BLOCK_M = 128  # the largest block_m of the grouped Triton kernels' tile configs (kernels.fused_moe and
#   kernels.mxfp4's config functions): each expert's block of the padded pair index pads to it (int32 per row)


SAMPLER_CHUNK_ELEMS = 1 << 20  # logit elements per sampler call: pipeline.sampling.sample draws rows in chunks of
#   sampler_rows(V) rows, so the sampler's temporaries are bounded whatever the micro-batch
SAMPLER_BYTES_PER_ELEM = 48  # GPU bytes per logit element inside kernels.sampling.sample_tokens at its peak (counted:
#   fp32 scores 4, top-p's sorted values 4 + order 8 + softmax 4 + cumsum 4 + mask 1, or the race's int64 hash 8 + its
#   shifted copy 8 + fp32 uniforms 4: at most 29; 48 leaves the allocator's rounding room)


def sampler_rows(vocab_size: int) -> int:
    """Rows of logits one sampler call takes (:data:`SAMPLER_CHUNK_ELEMS` / V, at least 1)."""
    return max(1, SAMPLER_CHUNK_ELEMS // vocab_size)


def micro_batch_workspace(spec: MoESpec, tokens: int, logit_rows: int, dtype: str = "bf16", groups: int = 2,
                          sampling: bool = False) -> int:
    """Bytes of GPU temporaries of one decode micro-batch of ``tokens`` rows through one layer (its input hidden
    rows are counted by :func:`decode_row_bytes`), with ``logit_rows`` rows of the final lm_head and ``groups``
    expert groups (:func:`expert_groups`).

    The layer's stages run one after the other, so the peak is q/k/v (alive for the whole layer) plus the larger
    of the attention stage and the FFN stage (:func:`_ffn_stage_bytes`); the head adds its own rows:
    ``logit_rows (D b + V b)`` (final norm and the lm_head output before its fp32 copy, which decode_row_bytes
    keeps); with ``sampling`` the sampler then runs on at most :func:`sampler_rows` rows at a time
    (:data:`SAMPLER_BYTES_PER_ELEM`).
    """
    b = dtype_bytes(dtype)
    T = tokens
    qkv = T * (spec.attn_query_elems + spec.kv_elems_per_token) * b
    attn = T * (spec.attn_query_elems + spec.attn_output_elems) * b  # rotated q + attention output
    head = logit_rows * (spec.hidden_size + spec.vocab_size) * b
    sample = (min(logit_rows, sampler_rows(spec.vocab_size)) * spec.vocab_size * SAMPLER_BYTES_PER_ELEM
              if sampling else 0)  # a sampled step (greedy is an argmax: no temporaries)
    return qkv + max(attn, _ffn_stage_bytes(spec, T, dtype, groups), head, sample)


def _ffn_stage_bytes(spec: MoESpec, T: int, dtype: str, groups: int = 2) -> int:
    """Temporaries of post-attention for T tokens at its peak, inside the grouped expert kernel's call: the attention
    output (alive until the layer ends), the residual after o_proj and the FFN norm, router outputs (fp32 logits /
    probabilities, top-k weights and ids), the kernel's pair indexes, gate|up product [T k, F] in the dtype, slot
    outputs [T k, D] fp32, their fp32 sum and its cast; with ``groups`` = 2 (paged and resident experts in separate
    calls: :func:`expert_groups`) the first group's result beside the second's; the shared / dense FFN
    intermediate; each expert's padding of the Triton kernels' pair index (:data:`MAX_BLOCK_M` int32 rows).
    The grouped_mm kernel (kernels.fused_moe.fused_experts_grouped_mm) holds no more: its gate/up GEMMs
    run in column chunks chosen to fit these per-pair bytes (grouped_mm_gate_up_chunks); the per-expert GEMM loop
    (fused_experts_mm_loop) holds the same per pair and ``FFN_SPARE_ROWS`` padding rows of its [P, D] and [P, F]
    buffers."""
    b = dtype_bytes(dtype)
    D, F, k, E = spec.hidden_size, spec.intermediate_size, spec.top_k, spec.num_experts
    P = T * k
    side = max(spec.num_shared_experts * spec.shared_intermediate_size, spec.dense_intermediate_size)
    return (T * spec.attn_output_elems * b + 2 * T * D * b + 2 * T * E * 4 + T * k * 12
            + P * 48 + P * F * b + P * D * 4 + T * D * 4 + groups * T * D * b + T * 3 * side * b
            + FFN_SPARE_ROWS * (D + F) * b + E * MAX_BLOCK_M * 4)


def expert_groups(weight_quant: str) -> int:
    """Grouped-kernel calls per MoE layer whose results coexist: 1 for quantized pages (every expert is dequantized
    into one dense scratch: pipeline.expert_ffn.GroupedQuantExpertFFN), 2 for dense pages (GroupedExpertFFN calls the
    kernel once for the paged and once for the resident experts; counted for every policy, also one without resident
    experts, since the MILP's linear rows cannot tell a layer's mix)."""
    return 1 if weight_quant in QUANT_FORMATS else 2


def prefill_chunk_workspace(spec: MoESpec, tokens: int, padded: int, longest: int, dtype: str = "bf16",
                            cpu_kv: bool = True, groups: int = 2) -> int:
    """Bytes of GPU temporaries of one prefill micro-batch (chunk) through one layer: ``tokens`` packed tokens,
    ``padded`` = rows x longest row, ``longest`` the longest row (its input hidden rows are counted by
    :func:`prefill_token_bytes`).

    q/k/v (alive for the layer) + the larger of: packed attention (q, k, v gathered to the padded layout and k, v
    repeated to every query head, the SDPA output and its packed copy: 4 padded x q, the selected rows: tokens x q,
    with a sliding window or sinks the boolean mask rows x longest^2 and SDPA's copy of it in the dtype) and the FFN stage
    (:func:`_ffn_stage_bytes` with ``groups`` expert groups); with ``cpu_kv`` (some micro-batch keeps its KV on the
    CPU) + k/v of two chunks on their way there.
    """
    b = dtype_bytes(dtype)
    q, kv = spec.attn_query_elems, spec.kv_elems_per_token // 2
    T = tokens
    qkv = T * (q + 2 * kv) * b
    # Kept conservative for every fused path: the planner cannot know that the run's host has CUDA and triton nor
    # the run's LIGHTNING_MOE_PREFILL_ATTENTION, so the padded call's temporaries (and with sinks the materialized
    # scores of gpt-oss's torch path) stay counted. They bound what the fused kernels allocate: torch's varlen and
    # the Triton kernel (kernels.prefill_attention.attention_varlen_triton, issue 44: MLA, fp32, sinks) allocate
    # only the [T, Hq, v_hd] output (<= the selected rows' tokens x q), no padded copy and no [S, S] scores.
    attn = _packed_attention_stage_bytes(spec, T, padded, longest, dtype)
    return qkv + max(attn, _ffn_stage_bytes(spec, T, dtype, groups)) + (2 * T * 2 * kv * b if cpu_kv else 0)


def _packed_attention_stage_bytes(spec: MoESpec, tokens: int, padded: int, longest: int, dtype: str) -> int:
    """Temporaries of packed prefill attention (model.layers.prefill_attention_packed) above q/k/v: 4 padded x q
    (gathered q, repeated k and v, the SDPA output; then its packed copy), the selected rows (tokens x q), and with a
    sliding window or sinks the boolean mask (rows x longest^2) and SDPA's copy of it in the dtype (full causal
    attention passes no mask). With attention sinks (gpt-oss's torch path, taken off CUDA or without triton) the
    [rows, Hq, longest, longest] scores are materialized: the matmul output and its masked copy in the
    dtype, the fp32 copy, the fp32 concatenation with the sink column and its softmax, the probabilities in the dtype
    (3 b + 12 bytes per score). Counted also where the Triton kernel will run (it allocates none of them): see
    :func:`prefill_chunk_workspace`."""
    b, q = dtype_bytes(dtype), spec.attn_query_elems
    scores = padded * longest * spec.num_heads * (3 * b + 12) if spec.attention_sinks else 0
    mask = padded * longest * (1 + b) if spec.sliding_window is not None or spec.attention_sinks else 0
    return 4 * padded * q * b + tokens * q * b + mask + scores


def score_head_bytes(spec: MoESpec, tokens: int, dtype: str = "bf16") -> int:
    """Bytes of the chunked scoring head over ``tokens`` packed tokens: per chunk of SCORE_CHUNK_TOKENS rows the final
    norm (D b), lm_head output (V b), its fp32 copy and log-softmax (2 V 4); + fp32 log-prob and bool greedy flag of
    every token (and the int64 clamped target).

    A bound, not the peak of every path: it counts the torch path (``pipeline.token_scores`` on the CPU, or without
    triton, or for a family head with math after the fp32 cast). The CUDA kernel path (``kernels.score_head``) holds
    only the norm and the model-dtype lm_head output per chunk (no fp32 copy, no log-softmax: ``c (D b + V b)``),
    so the planner over-counts its transient by ``c V 8`` bytes; kept so that a plan stays valid on either path."""
    c = min(tokens, SCORE_CHUNK_TOKENS)
    b = dtype_bytes(dtype)
    return c * (spec.hidden_size * b + spec.vocab_size * (b + 8)) + tokens * (4 + 1 + 8)


def gpu_decode_attention_workspace(spec: MoESpec, rows: int, context: int, dtype: str = "bf16") -> int:
    """Bytes of one GPU-attention micro-batch's decode attention over its KV (the torch path: per length group the
    fp32 scores, their masked copy and fp32 softmax [rows, Hq, context], the probabilities in the dtype), at most
    ``rows`` rows of ``context`` positions. MLA (``latent_attention_torch``): the fp32 copy of the latents
    [rows, context, kv_lora + rope] (keys; later the values' [.., kv_lora], smaller) beside up to three fp32
    [rows, Hq, context] score tensors."""
    if spec.is_mla:
        return rows * context * (spec.num_heads * 3 * 4 + (spec.kv_lora_rank + spec.qk_rope_head_dim) * 4)
    return rows * spec.num_heads * context * (3 * 4 + dtype_bytes(dtype))


_SLACK = ("allocator reserve", "fragmentation allowance")  # budgeted components that are not tensors


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes by component: GPU per phase ("prefill" and "decode" for generation, "scoring" for prefill-only
    scoring), and host in two phases: the run ("cpu") and the weight load before it ("cpu_load")."""

    gpu_phases: dict  # phase -> {component: bytes}
    cpu: dict  # component -> bytes on the host while the executor runs (pool, KV, staging, reserve)
    cpu_load: dict = field(default_factory=dict)  # component -> host bytes while the checkpoint is read into the page
    #   pool layer by layer, empty when not modelled

    @property
    def gpu_prefill(self) -> dict:
        """Components of the prefill phase ("scoring" for a scoring workload)."""
        return self.gpu_phases.get("prefill", self.gpu_phases.get("scoring", {}))

    @property
    def gpu_decode(self) -> dict:
        """Components of the decode phase (empty for scoring)."""
        return self.gpu_phases.get("decode", {})

    def phase_total(self, phase: str) -> int:
        """Bytes of ``phase`` with the allocator reserve."""
        return sum(self.gpu_phases[phase].values())

    def phase_allocated(self, phase: str) -> int:
        """Bytes allocated at the peak of ``phase`` (what ``torch.cuda.max_memory_allocated`` measures): the components
        without the allocator reserve, plus the library workspaces, which the reserve covers (with the CUDA context
        and the caching allocator's fragmentation)."""
        return sum(v for k, v in self.gpu_phases[phase].items() if k not in _SLACK) + LIBRARY_WORKSPACE

    @property
    def gpu_peak(self) -> int:
        """max over phases of the total in bytes (reserve included: what must fit the budget)."""
        return max(self.phase_total(p) for p in self.gpu_phases)

    @property
    def gpu_peak_allocated(self) -> int:
        """max over phases of the allocated bytes (reserve excluded)."""
        return max(self.phase_allocated(p) for p in self.gpu_phases)

    @property
    def gpu_peak_phase(self) -> str:
        """The phase with the largest GPU total."""
        return max(self.gpu_phases, key=self.phase_total)

    @property
    def gpu_breakdown(self) -> dict:
        """Components of the peak phase."""
        return self.gpu_phases[self.gpu_peak_phase]

    @property
    def cpu_peak_phase(self) -> str:
        """The host phase with the larger total: "run" or "load"."""
        return "load" if sum(self.cpu_load.values()) > sum(self.cpu.values()) else "run"

    @property
    def cpu_peak(self) -> int:
        """Host peak in bytes: max of the run's and the weight load's totals."""
        return max(sum(self.cpu.values()), sum(self.cpu_load.values()))

    @property
    def cpu_breakdown(self) -> dict:
        """Components of the host peak phase."""
        return self.cpu_load if self.cpu_peak_phase == "load" else self.cpu


def kv_bytes_per_position(spec: MoESpec, dtype: str = "bf16") -> int:
    """Bytes of K and V of one token position over all layers: L * 2 Hkv hd * b."""
    return spec.num_layers * spec.kv_elems_per_token * dtype_bytes(dtype)


def kv_cache_bytes(policy: Policy, spec: MoESpec, workload: Workload) -> tuple[int, int]:
    """(GPU, CPU) bytes of the KV caches of a batch of N = mu * n sequences, an upper bound of what
    CGOPipe's GroupedKVCaches allocate for any batch of the job (0, 0 for a scoring workload: no KV).

    The executor keeps the n_gpu_attn shortest micro-batches on the GPU, so the CPU holds the N_cpu =
    (n - n_gpu_attn) mu longest rows of the batch: CPU positions = N_cpu * kv_positions(N_cpu), GPU
    positions = N_gpu * kv_positions(N) (the shortest rows of the batch pad to at most its mean). Without
    prompt lengths both are sequences * (max_prompt + gen_len), the ungrouped S_max.
    """
    if workload.scoring:
        return 0, 0
    per_pos = kv_bytes_per_position(spec, policy.dtype)
    n_cpu, n_gpu = policy.n_cpu_attn * policy.mu, policy.n_gpu_attn * policy.mu

    def total(seqs: int, mean_of: int) -> int:
        return math.ceil(seqs * workload.kv_positions(mean_of) * per_pos) if seqs else 0

    return total(n_gpu, policy.N), total(n_cpu, n_cpu)


def dequant_scratch_bytes(spec: MoESpec, quant: str, dtype: str = "bf16", gpus: int = 1) -> int:
    """Bytes of CGOPipe's dense scratch for one layer's dequantized experts (paged and resident):
    ``E * expert_bytes(dtype)`` when ``quant`` is a quantized format, else 0 (with ``gpus`` > 1: ceil(E / g) experts,
    one GPU's share, H10)."""
    return paged_per_gpu(spec.num_experts, gpus) * spec.expert_bytes(dtype) if quant in QUANT_FORMATS else 0


PREFILL_INDEX_BYTES = 34  # per prompt token: position (8 B) and prefill attention's src / keep / valid indexes (17 B per padded token, <= 2x)


def hidden_row_bytes(spec: MoESpec, dtype: str = "bf16") -> int:
    """GPU bytes per row of its hidden state (D) and RoPE cos / sin tables (2 hd), in ``dtype``."""
    return (spec.hidden_size + 2 * spec.head_dim) * dtype_bytes(dtype)


def decode_row_bytes(spec: MoESpec, dtype: str = "bf16") -> int:
    """GPU bytes per decode row CGOPipe keeps for a whole step: :func:`hidden_row_bytes`, its position (int64) and its
    fp32 logits [V] (every micro-batch's logits of a step are alive together until sampled)."""
    return hidden_row_bytes(spec, dtype) + 8 + spec.vocab_size * 4


def prefill_token_bytes(spec: MoESpec, dtype: str = "bf16") -> int:
    """GPU bytes per prompt token CGOPipe keeps for the whole prefill: the packed hidden row (D), the RoPE cos / sin
    tables (2 hd), its position and the attention indexes of its chunk (PREFILL_INDEX_BYTES)."""
    return hidden_row_bytes(spec, dtype) + PREFILL_INDEX_BYTES


def prefill_logit_bytes(spec: MoESpec, dtype: str = "bf16") -> int:
    """GPU bytes per generated sequence at the end of prefill: the fp32 logits [V] of its last prompt token."""
    return spec.vocab_size * 4


def prefill_chunk_shape(policy: Policy, workload: Workload) -> tuple[int, int, int]:
    """(tokens, padded tokens, longest row) of the largest prefill micro-batch the executor forms: at most
    ``prefill_mu`` rows and ``prefill_tokens`` padded tokens, or one longest prompt alone; its tokens are no more than
    the batch's prompt tokens, nor, with the job's prompt lengths, than :func:`packed_chunk_tokens` of them."""
    s_max = workload.max_prompt
    N = policy.N if workload.num_requests is None else min(policy.N, workload.num_requests)
    pmu = min(policy.prefill_mu, N)
    tp = min(pmu * s_max, max(policy.prefill_tokens, s_max))
    tokens = min(tp, workload.prompt_tokens(N))
    if workload.prompt_lens is not None:
        tokens = min(tokens, packed_chunk_tokens(workload.prompt_lens, pmu, policy.prefill_tokens))
    return tokens, tp, min(s_max, tp)


def packed_chunk_tokens(prompt_lens: tuple, rows: int, padded_tokens: int) -> int:
    """Most packed tokens one prefill chunk can hold, whatever the order of its rows: a chunk whose longest row has L
    tokens takes at most k(L) = max(1, min(rows, padded_tokens // L)) rows (the chunker's caps), each of at most L
    tokens, so it holds at most the sum of the k(L) longest lengths <= L; the max over the lengths present."""
    return _packed_chunk_tokens(tuple(prompt_lens), int(rows), int(padded_tokens))


@lru_cache(maxsize=256)
def _packed_chunk_tokens(prompt_lens: tuple, rows: int, padded_tokens: int) -> int:
    desc = sorted(prompt_lens, reverse=True)
    prefix = [0]
    for x in desc:
        prefix.append(prefix[-1] + x)
    best, n = 0, len(desc)
    for i, L in enumerate(desc):
        if i and L == desc[i - 1]:
            continue  # the same L from its first position: the largest sum of k(L) lengths <= L
        k = rows if L == 0 else max(1, min(rows, padded_tokens // L))
        best = max(best, prefix[min(n, i + k)] - prefix[i])
    return best


def memory_estimate(policy: Policy, spec: MoESpec, workload: Workload) -> MemoryEstimate:
    """Peak GPU bytes per phase and host bytes of ``policy`` (every allocation CGOPipe makes, DESIGN.md memory model).

    Every phase: non-expert weights, resident experts, 2 page buffers (the largest non-resident set of one MoE layer
    each), for quantized pages the dense scratch of one layer's E experts, the allocator reserve (which covers the
    CUDA context and LIBRARY_WORKSPACE) and a fragmentation allowance of FRAGMENTATION x the phase's transient
    workspace (the two slack components are budgeted but are not tensors: :meth:`MemoryEstimate.phase_allocated`).
    Generation, prefill: GPU KV cache, the batch's packed prompt rows, one prefill chunk's layer temporaries and the
    last-token logits of the N sequences (the head runs after the last layer, so the two never coexist; counted both,
    as the MILP's linear rows do). Decode: GPU KV, N decode rows (hidden, RoPE, logits), two micro-batches'
    temporaries in flight, and attention scores for every GPU-attention row (linear in those rows, as in the MILP;
    one micro-batch's are alive at a time). Scoring (``workload.scoring``): no KV; the batch's packed rows and the larger of
    one chunk's layer temporaries and the chunked scoring head. With ``policy.gpus`` g > 1 (H10) the GPU phases are
    one GPU's (ceil(r / g) resident and ceil((E - r) / g) paged experts per layer) and the host holds g processes' CPU
    KV, staging, reserves and non-expert weights at load (each process reads only its own experts).
    Raises PolicyError if the resident experts do not fit the spec.
    """
    b = dtype_bytes(policy.dtype)
    We = spec.expert_bytes(policy.weight_quant)
    counts = policy.resident_counts(spec)
    R = sum(counts)
    g = policy.gpus  # (H10) GPU components are per GPU; host components of the processes add up
    max_paged = max((paged_per_gpu(spec.num_experts - c, g) for i, c in enumerate(counts) if not spec.is_dense_layer(i)),
                    default=0)
    R_gpu = sum(paged_per_gpu(c, g) for c in counts)  # resident experts on the GPU holding the most (GPU 0)
    mu = policy.mu
    # sequences of the largest batch: the policy's N, or every sequence of a smaller job (the runner's batches hold
    # no more than the job has)
    N = policy.N if workload.num_requests is None else min(policy.N, workload.num_requests)
    kv_gpu, kv_cpu = kv_cache_bytes(policy, spec, workload)
    tp, padded, longest = prefill_chunk_shape(policy, workload)
    common = {
        "non-expert weights": spec.non_expert_bytes(policy.dtype),
        "resident experts": R_gpu * We,
        "expert page buffers (2)": 2 * max_paged * We,
        "dequantized expert scratch": dequant_scratch_bytes(spec, policy.weight_quant, policy.dtype, g),
    }
    rows = workload.prompt_tokens(N) * prefill_token_bytes(spec, policy.dtype)
    chunk = prefill_chunk_workspace(spec, tp, padded, longest, policy.dtype,
                                    cpu_kv=not workload.scoring and policy.n_gpu_attn < policy.n,
                                    groups=(groups := expert_groups(policy.weight_quant)))
    phases: dict = {}
    if workload.scoring:
        transient = max(chunk, score_head_bytes(spec, tp, policy.dtype))
        phases["scoring"] = {**common, "packed rows (N sequences)": rows, "prefill chunk / scoring head": transient,
                             "fragmentation allowance": math.ceil(FRAGMENTATION * transient),
                             "allocator reserve": policy.gpu_reserve}
    else:
        pmu = min(policy.prefill_mu, N)
        head = N * prefill_logit_bytes(spec, policy.dtype) + pmu * (spec.hidden_size + spec.vocab_size) * b
        phases["prefill"] = {**common, "GPU KV cache": kv_gpu, "prefill hidden states (N prompts)": rows,
                             "prefill chunk workspace": chunk, "last-token logits (N) + head": head,
                             "fragmentation allowance": math.ceil(FRAGMENTATION * chunk),
                             "allocator reserve": policy.gpu_reserve}
        ctx = workload.max_prompt + workload.gen_len
        attn_ws = gpu_decode_attention_workspace(spec, policy.n_gpu_attn * mu, ctx, policy.dtype)
        phases["decode"] = {**common, "GPU KV cache": kv_gpu, "decode rows (N: hidden, logits)": N * decode_row_bytes(spec, policy.dtype),
                            "decode workspaces (2 micro-batches)": (ws := 2 * micro_batch_workspace(spec, mu, mu, policy.dtype, groups, workload.sampling)
                                                                    + attn_ws),
                            "fragmentation allowance": math.ceil(FRAGMENTATION * ws),
                            "allocator reserve": policy.gpu_reserve}
    cpu_seqs = policy.n_cpu_attn * mu
    cpu = {
        "pinned experts (not resident)": (spec.num_moe_layers * spec.num_experts - R) * We,
        "CPU KV cache": kv_cpu * g,
        "pinned staging": (2 * cpu_seqs * (spec.attn_query_elems + spec.kv_elems_per_token + spec.attn_output_elems) * b
                           + 2 * tp * spec.kv_elems_per_token * b) * g,
        "host reserve": policy.cpu_reserve * g,
    }
    # the weight load: the executor copies the other weights to the GPU (releasing their host copies), then reads the
    # experts layer by layer, the resident ones to the GPU and the rest into the pool, so the host holds the pool as
    # filled so far and one layer's experts as read
    cpu_load = {
        "page pool (filled layer by layer)": cpu["pinned experts (not resident)"],
        "one layer's experts (host, as read)": spec.num_experts * We * g,
        "host reserve": policy.cpu_reserve * g,
    }
    return MemoryEstimate(gpu_phases=phases, cpu=cpu, cpu_load=cpu_load)


def _less_than(have: int, need: int) -> str:
    """"A GiB < B GiB" with enough decimals that the two differ (1.0 GiB < 1.0 GiB says nothing)."""
    for d in (1, 2, 3):
        a, b = f"{have / 2**30:.{d}f}", f"{need / 2**30:.{d}f}"
        if a != b:
            break
    else:
        a, b = f"{have:,}", f"{need:,}"
        return f"{a} B < {b} B"
    return f"{a} GiB < {b} GiB"


def memory_violations(policy: Policy, spec: MoESpec, workload: Workload) -> list[str]:
    """One line per budget the policy exceeds (empty when it fits; a 0 budget is unchecked)."""
    m = memory_estimate(policy, spec, workload)
    out = []
    if policy.gpu_budget and m.gpu_peak > policy.gpu_budget:
        out.append(f"GPU memory {_less_than(policy.gpu_budget, m.gpu_peak)} needed ({m.gpu_peak_phase}: "
                   + ", ".join(f"{k} {format_bytes(v)}" for k, v in m.gpu_breakdown.items() if v) + ")")
    if policy.cpu_budget and m.cpu_peak > policy.cpu_budget:
        what = "reading the checkpoint: " if m.cpu_peak_phase == "load" else ""
        out.append(f"host memory {_less_than(policy.cpu_budget, m.cpu_peak)} needed ({what}"
                   + ", ".join(f"{k} {format_bytes(v)}" for k, v in m.cpu_breakdown.items() if v) + ")")
    return out


def check_memory(policy: Policy, spec: MoESpec, workload: Workload) -> MemoryEstimate:
    """Memory estimate of ``policy``; raises PlanInfeasible (one line) if it exceeds policy.gpu_budget/cpu_budget."""
    bad = memory_violations(policy, spec, workload)
    if bad:
        raise PlanInfeasible("infeasible: " + "; ".join(bad))
    return memory_estimate(policy, spec, workload)


# ---- evaluation ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    """Predicted times (s), throughputs (tokens/s) and peak memory (bytes) of one policy (H7-H9)."""

    N: int  # sequences in flight
    prompt_len: float  # mean prompt tokens
    max_prompt_len: int  # longest prompt tokens
    gen_len: int  # generated tokens per sequence
    prefill_time: float  # seconds
    decode_time: float  # seconds (decode steps 1..G-1)
    prefill_stages: dict  # stage -> seconds summed over layers ("head": not overlapped)
    decode_stages: dict  # stage -> seconds summed over steps and layers
    prefill_binding: str  # stage that sets most of the prefill time
    decode_binding: str  # stage that sets most of the decode time
    prefill_layers: tuple  # StageTimes per layer (prefill)
    decode_first_layers: tuple  # StageTimes per layer at the first decode step (empty if G == 1)
    decode_last_layers: tuple  # StageTimes per layer at the last decode step
    memory: MemoryEstimate  # peak bytes by component
    notes: tuple = ()  # lines on what the estimate leaves out (evaluate's) and on how it was solved (the planner's)
    job_rows: tuple = ()  # rows of each batch of the job (policy.jobplan.fit_job; empty: the job is one batch of N)
    job_time: float = 0.0  # seconds of the whole job, every batch summed (0: not planned as a job)
    refill_min_free: int = 0  # the refill threshold the job plan chose (policy.jobplan; 0: the executor's default)
    host_probe: str = ""  # the profile's host probe that priced the decode host stage (H6'): a host_issue_by_family key
    #   ("qwen3_moe", "mixtral/int4", "mla") or "generic" (:func:`host_probe`); "": no host stage (or no decode)

    @property
    def job_e2e_tok_s(self) -> float:
        """The job's end-to-end generated tokens / s: sum(job_rows) G / job_time (every batch, the tail too); the
        batch's :attr:`e2e_tok_s` when the estimate was not planned as a job."""
        if not self.job_rows or self.job_time <= 0:
            return self.e2e_tok_s
        return sum(self.job_rows) * self.gen_len / self.job_time

    @property
    def total_time(self) -> float:
        """T_prefill + T_decode in seconds."""
        return self.prefill_time + self.decode_time

    @property
    def prefill_tok_s(self) -> float:
        """(H9) prompt tokens / s during prefill: N * prompt_len / T_prefill."""
        return self.N * self.prompt_len / self.prefill_time if self.prefill_time > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """(H9) generated tokens / s during decode steps: N * (G - 1) / T_decode (0 when G == 1)."""
        return self.N * (self.gen_len - 1) / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def e2e_tok_s(self) -> float:
        """(H9) end-to-end generated tokens / s: N * G / (T_prefill + T_decode) -- the planner's objective."""
        return self.N * self.gen_len / self.total_time

    @property
    def gpu_peak(self) -> int:
        """Peak GPU bytes (max over prefill and decode)."""
        return self.memory.gpu_peak

    @property
    def gpu_peak_phase(self) -> str:
        """Phase of the GPU peak."""
        return self.memory.gpu_peak_phase

    @property
    def gpu_breakdown(self) -> dict:
        """GPU components at the peak."""
        return self.memory.gpu_breakdown

    @property
    def cpu_peak(self) -> int:
        """Peak host bytes."""
        return self.memory.cpu_peak

    @property
    def cpu_breakdown(self) -> dict:
        """Host components while the executor runs (the weight load's: ``memory.cpu_load``)."""
        return self.memory.cpu


def evaluate(policy: Policy, spec: MoESpec, hw: HardwareProfile, workload: Workload) -> Estimate:
    """(H1)-(H9): predicted prefill/decode times, per-stage sums, binding stages, throughputs and peak memory.

    Decode sums over steps j = 1..G-1 with context prompt_len + j (CPU and GPU attention rows shifted by
    Workload.attention_context_offsets); every layer uses its own resident count
    (layers with the same kind and count are computed once and weighted by their number).
    Raises PolicyError if the policy's resident experts do not fit the spec. Does not check budgets
    (see check_memory).
    """
    counts = policy.resident_counts(spec)
    s, G = workload.prompt_len, workload.gen_len
    keys = [_layer_key(spec, i, c) for i, c in enumerate(counts)]
    classes: dict = {}
    for k in keys:
        classes[k] = classes.get(k, 0) + 1
    first_layer = {k: keys.index(k) for k in classes}

    def run(fn, arg) -> tuple[float, dict, dict, dict]:
        rows = {k: fn(spec, hw, policy, first_layer[k], k[1], arg) for k in classes}
        sums, bound, total = dict.fromkeys(STAGES, 0.0), dict.fromkeys(STAGES, 0.0), 0.0
        for k, st in rows.items():
            w, t = classes[k], st.time
            total += w * t
            for name in STAGES:
                sums[name] += w * getattr(st, name)
            bound[st.binding] += w * t
        return total, sums, bound, rows

    t_prefill, pre_sums, pre_bound, pre_rows = run(prefill_layer_times, s)
    head_p = prefill_head_time(spec, hw, policy, s, all_tokens=workload.scoring)
    t_prefill += head_p
    pre_sums["head"] = head_p

    dec_sums = dict.fromkeys(STAGES, 0.0)
    dec_bound = dict.fromkeys(STAGES, 0.0)
    t_decode = 0.0
    head_d = decode_head_time(spec, hw, policy)
    first: dict = {}
    last: dict = {}
    dc, dg = workload.attention_context_offsets(policy.N, policy.mu, policy.n, policy.n_gpu_attn)

    def decode_times(spec_, hw_, pol_, layer, nr, context):
        return decode_layer_times(spec_, hw_, pol_, layer, nr, context, dc, dg)

    for j in range(1, G):
        total, sums, bound, rows = run(decode_times, s + j)
        t_decode += total + head_d
        for name in STAGES:
            dec_sums[name] += sums[name]
            dec_bound[name] += bound[name]
        if j == 1:
            first = rows
        last = rows
    dec_sums["head"] = head_d * (G - 1)
    prefill_layers = [pre_rows[k] for k in keys]
    first = [first[k] for k in keys] if first else []
    last = [last[k] for k in keys] if last else []
    probe = host_probe(hw, spec, policy.weight_quant) if G > 1 else ""  # "": no host stage (or no decode)

    return Estimate(
        N=policy.N, prompt_len=s, max_prompt_len=workload.max_prompt, gen_len=G,
        prefill_time=t_prefill, decode_time=t_decode,
        prefill_stages=pre_sums, decode_stages=dec_sums,
        prefill_binding=max(STAGES, key=pre_bound.__getitem__),
        decode_binding=max(STAGES, key=dec_bound.__getitem__) if G > 1 else "-",
        prefill_layers=tuple(prefill_layers), decode_first_layers=tuple(first), decode_last_layers=tuple(last),
        memory=memory_estimate(policy, spec, workload),
        notes=_estimate_notes(hw, policy, G, probe),
        host_probe=probe,
    )


def _estimate_notes(hw: HardwareProfile, policy: Policy, G: int, probe: str) -> tuple:
    """An estimate's notes: no host stage (a decode without the profile's host measurement); no host DRAM sharing
    rows (a measured profile, one with a host stage, that lacks (H5')'s point, for a decode with CPU attention)."""
    if G <= 1:
        return ()
    if not probe:
        return (NO_HOST_STAGE_NOTE.format(hw=hw.name),)
    return (NO_DRAM_SHARING_NOTE.format(hw=hw.name),) if policy.n_cpu_attn and dram_sharing(hw) is None else ()


# ---- a refilling call's steps and passes (policy.refill_schedule prices its schedule with these) -------------------
def _layer_key(spec: MoESpec, layer: int, resident: int) -> tuple:
    """A decoder layer's pricing class: (dense, paged experts, attention window or None); layers of one class cost the
    same in every HRM term."""
    dense = spec.is_dense_layer(layer)
    return dense, 0 if dense else spec.num_experts - resident, spec.layer_sliding_window(layer)


def _layer_classes(policy: Policy, spec: MoESpec) -> dict:
    """:func:`_layer_key` -> (first layer of that kind, layers of that kind): layers priced once per class."""
    counts = policy.resident_counts(spec)
    out: dict = {}
    for i, c in enumerate(counts):
        key = _layer_key(spec, i, c)
        first, w = out.get(key, (i, 0))
        out[key] = (first, w + 1)
    return out


def decode_step_time(policy: Policy, spec: MoESpec, hw: HardwareProfile, workload: Workload, context: float) -> float:
    """(H7) one decode step of all N slots at ``context`` attended positions per slot: every layer's (H2) at that
    context (CPU / GPU rows shifted by Workload.attention_context_offsets, as :func:`evaluate`) + the head."""
    dc, dg = workload.attention_context_offsets(policy.N, policy.mu, policy.n, policy.n_gpu_attn)
    return (sum(w * decode_layer_times(spec, hw, policy, first, key[1], context, dc, dg).time
                for key, (first, w) in _layer_classes(policy, spec).items())
            + decode_head_time(spec, hw, policy))


def prefill_pass_time(policy: Policy, spec: MoESpec, hw: HardwareProfile, rows: int, prompt_len: float) -> float:
    """(H8) one prefill pass of ``rows`` sequences of ``prompt_len`` mean tokens over every layer's pages (a refill:
    its rows spread over the micro-batches, so a share n_cpu_attn / n of them has CPU KV) + its head."""
    cpu_rows = rows * policy.n_cpu_attn / policy.n
    return (sum(w * prefill_layer_times(spec, hw, policy, first, key[1], prompt_len, rows, cpu_rows).time
                for key, (first, w) in _layer_classes(policy, spec).items())
            + prefill_head_time(spec, hw, policy, prompt_len, rows=rows))
