"""The hierarchical roofline of a plan, drawn (``moe-batch plan --plot FILE.png``).

Left: the HRM's ceilings for this host (MoE-Lightning Sec. 3, Fig. 3): the compute roofs of the GPU (the dtype's
GEMM peak, and the grouped expert kernel's measured rate when the profile has one) and of the CPU attention
routine; the memory roofs of GPU HBM and of host DRAM as the CPU attention reads it; and the cross-level roof of
PCIe host-to-device, for work whose bytes cross the link. The chosen policy's operations sit on them at their
operational intensity (FLOP per byte of the level they read from):

  decode attention   FLOP 4 q C per row and layer over C cached positions, bytes C kv b of KV: on the CPU roofs
                     (and the GPU's when some micro-batches attend there)
  expert FFN, decode  one layer for the batch's N tokens: FLOP 2 N k P_e, against the pages that cross PCIe
                     (the paged experts, E - resident) and against HBM (the experts a micro-batch touches)
  expert FFN, prefill the same for the batch's N x prompt tokens

A point's height is what its roofs allow, min(peak, intensity x bandwidth). Right: the predicted seconds of each
stream (PCIe both ways, CPU, GPU, host issue) for prefill and decode, the binding one marked (the overlapped streams
take the longest one's time; the head is added to it, not overlapped).
matplotlib is an optional dependency (``pip install 'lightning-moe[plot]'``).

:func:`save_timeline` draws a run's measured stage timeline (``moe-batch run --timeline FILE.png``): the spans the
cgopipe executor recorded (pipeline.stage_stats.StageTimer.take_spans) as horizontal bars, one lane per stage, the
phases (prefill, decode, scoring) shaded behind them; below, one decode step zoomed in.
"""

from __future__ import annotations

from .policy.hardware import HardwareProfile
from .policy.hrm import Estimate, active_experts
from .policy.policy import Policy, Workload
from .model.spec import MoESpec, dtype_bytes


class PlotError(RuntimeError):
    """matplotlib is missing, or the file cannot be written."""


def roofline_points(spec: MoESpec, hw: HardwareProfile, policy: Policy, workload: Workload) -> list[dict]:
    """The policy's operations as roofline points: ``{"label", "intensity" (FLOP/byte), "roof" (level name),
    "flops_per_s" (attainable)}``."""
    b = dtype_bytes(policy.dtype)
    q, kv = spec.attn_query_elems, spec.kv_elems_per_token
    gpu_peak = hw.gpu_flops(policy.dtype)
    expert_peak = min(gpu_peak, hw.gpu_expert_flops) if hw.gpu_expert_flops > 0 else gpu_peak
    pts = []

    def add(label, flops, nbytes, peak, bandwidth, roof):
        if nbytes <= 0 or flops <= 0:
            return
        i = flops / nbytes
        pts.append({"label": label, "intensity": i, "roof": roof, "flops_per_s": min(peak, i * bandwidth)})

    context = workload.prompt_len + workload.gen_len / 2  # mean attended positions over decode
    if not workload.scoring:
        attn_flops, attn_bytes = 4 * q * context, context * kv * b
        if policy.n_cpu_attn:
            add(f"decode attention, CPU ({policy.n_cpu_attn} x {policy.mu} rows)", attn_flops, attn_bytes,
                hw.cpu_attention_flops, hw.cpu_attention_bandwidth, "CPU")
        if policy.n_gpu_attn:
            add(f"decode attention, GPU ({policy.n_gpu_attn} x {policy.mu} rows)", attn_flops, attn_bytes,
                gpu_peak, hw.gpu_hbm_bandwidth, "GPU")
    counts = policy.resident_counts(spec)
    moe = [c for i, c in enumerate(counts) if not spec.is_dense_layer(i)]
    paged = spec.num_experts - (sum(moe) / len(moe) if moe else 0)
    We = spec.expert_bytes(policy.weight_quant)
    k, Pe = spec.top_k, spec.expert_params
    N = policy.N if workload.num_requests is None else min(policy.N, workload.num_requests)
    if not workload.scoring:
        add(f"expert FFN, decode (N = {N}) over PCIe", 2 * N * k * Pe, paged * We, expert_peak, hw.pcie_h2d, "PCIe")
        mu = policy.mu
        add(f"expert FFN, decode micro-batch ({mu}) from HBM", 2 * mu * k * Pe, active_experts(mu, spec.num_experts, k) * We,
            expert_peak, hw.gpu_hbm_bandwidth, "GPU")
    T = N * workload.prompt_len
    add(f"expert FFN, prefill ({T:,.0f} tokens) over PCIe", 2 * T * k * Pe, paged * We, expert_peak, hw.pcie_h2d, "PCIe")
    return pts


def save_plan_plot(path: str, spec: MoESpec, hw: HardwareProfile, policy: Policy, workload: Workload,
                   est: Estimate) -> str:
    """Draw the roofline and the predicted stage times of ``policy`` to ``path`` (PNG, or any format matplotlib
    infers from the suffix). Returns ``path``. Raises PlotError."""
    plt = _pyplot("--plot")
    import numpy as np

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [3, 2]})
    x = np.logspace(-2, 6, 400)
    gpu_peak = hw.gpu_flops(policy.dtype)
    roofs = [("GPU HBM", hw.gpu_hbm_bandwidth, gpu_peak, "tab:green"),
             ("PCIe H2D", hw.pcie_h2d, gpu_peak, "tab:red"),
             ("CPU DRAM (attention)", hw.cpu_attention_bandwidth, hw.cpu_attention_flops, "tab:blue")]
    colors = {"GPU": "tab:green", "PCIe": "tab:red", "CPU": "tab:blue"}
    for name, bw, peak, c in roofs:
        ax.plot(x, np.minimum(x * bw, peak), color=c, lw=2, label=f"{name}: {bw / 1e9:,.0f} GB/s")
    ax.axhline(gpu_peak, color="black", ls="--", lw=1, label=f"GPU {policy.dtype} GEMM peak: {gpu_peak / 1e12:,.0f} TFLOP/s")
    if hw.gpu_expert_flops > 0:
        ax.axhline(min(gpu_peak, hw.gpu_expert_flops), color="gray", ls=":", lw=1,
                   label=f"grouped expert kernel: {min(gpu_peak, hw.gpu_expert_flops) / 1e12:,.0f} TFLOP/s")
    ax.axhline(hw.cpu_attention_flops, color="tab:blue", ls="--", lw=1,
               label=f"CPU attention: {hw.cpu_attention_flops / 1e9:,.0f} GFLOP/s")
    # each point carries its number; the legend says what it is (long labels beside the points overlap the roofs)
    for i, p in enumerate(roofline_points(spec, hw, policy, workload), 1):
        ax.scatter([p["intensity"]], [p["flops_per_s"]], s=70, zorder=5, color=colors[p["roof"]], edgecolor="black",
                   label=f"({i}) {p['label']}")
        ax.annotate(f"{i}", (p["intensity"], p["flops_per_s"]), textcoords="offset points", xytext=(-7, -15),
                    ha="center", fontsize=9, fontweight="bold")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e-2, 1e6)
    ax.set_ylim(min(hw.cpu_attention_flops, 1e10) / 10, gpu_peak * 3)
    ax.set_xlabel("operational intensity (FLOP per byte read from the roof's level)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(f"Hierarchical roofline: {spec.name} on {hw.name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")

    phases = [("prefill", est.prefill_stages, est.prefill_binding)]
    if est.decode_stages and est.decode_time > 0:
        phases.append(("decode", est.decode_stages, est.decode_binding))
    stages = sorted({s for _, st, _ in phases for s in st})
    ypos = 0
    ticks, labels = [], []
    for phase, st, binding in phases:
        for s in stages:
            v = st.get(s, 0.0)
            bx.barh(ypos, v, color="tab:orange" if s == binding else "tab:gray")
            bx.text(v, ypos, f" {v:.3g} s", va="center", fontsize=8)
            ticks.append(ypos)
            labels.append(f"{phase}: {s}" + (" (binding)" if s == binding else "")
                          + (" (not overlapped: added)" if s == "head" else ""))
            ypos += 1
        ypos += 0.6
    bx.set_yticks(ticks, labels, fontsize=8)
    bx.invert_yaxis()
    bx.set_xlabel("predicted seconds (summed over layers and steps)")
    title = (f"policy mu {policy.mu} x n {policy.n}, {sum(policy.resident_counts(spec))} resident experts\n"
             f"attention of {policy.n_gpu_attn} of {policy.n} micro-batches on the GPU")
    sub = f"prefill {est.prefill_tok_s:,.0f} tok/s" + ("" if workload.scoring else f", decode {est.decode_tok_s:,.1f} tok/s")
    bx.set_title(f"{title}\n{sub}", fontsize=10)
    return _save(plt, fig, path)


_LANE_COLORS = {"H2D expert pages": "tab:red", "GPU waits for pages": "tab:gray", "GPU attention": "tab:green",
                "GPU expert FFN": "tab:purple", "CPU attention (worker)": "tab:blue"}
_PHASE_COLORS = {"prefill": "#fff2cc", "decode": "#deebf7", "scoring": "#e2f0d9"}


def check_matplotlib(flag: str) -> None:
    """PlotError naming ``flag`` unless matplotlib can be imported (checked before a run, not after it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PlotError(f"{flag} needs matplotlib: pip install 'lightning-moe[plot]'") from e


def _pyplot(flag: str):
    """matplotlib.pyplot on the Agg backend (files only); PlotError naming ``flag`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotError(f"{flag} needs matplotlib: pip install 'lightning-moe[plot]'") from e
    return plt


def _save(plt, fig, path: str) -> str:
    """Lay out ``fig``, write it to ``path`` and close it; returns ``path`` (PlotError when it cannot be written)."""
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise PlotError(f"cannot write {path}: {e}") from e
    finally:
        plt.close(fig)
    return path


def _draw_lanes(ax, spans: list[dict], lanes: list[str], t0: float, t1: float) -> None:
    for ph in (s for s in spans if s["stage"] == "phase"):
        if ph["end"] > t0 and ph["start"] < t1:
            ax.axvspan(max(ph["start"], t0), min(ph["end"], t1), color=_PHASE_COLORS.get(ph["phase"], "#eeeeee"),
                       zorder=0)
    for y, lane in enumerate(lanes):
        for phase, hatch, alpha in (("prefill", "///", 0.6), ("decode", None, 0.95), ("scoring", "///", 0.6)):
            bars = [(s["start"], max(s["end"] - s["start"], 0.0)) for s in spans
                    if s["lane"] == lane and s["phase"] == phase and s["end"] > t0 and s["start"] < t1]
            if bars:
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=_LANE_COLORS.get(lane, "tab:olive"), alpha=alpha,
                               hatch=hatch, edgecolor="black" if hatch else "none", linewidth=0.2, zorder=2)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(t0, t1)
    ax.grid(True, axis="x", alpha=0.3)


def save_timeline(path: str, spans: list[dict], title: str) -> str:
    """Draw a run's measured stage timeline to ``path`` (PNG or any format matplotlib infers from the suffix).

    ``spans``: ``{"stage", "lane", "phase", "start", "end"}`` (seconds from the run's start; stage ``"phase"``: a
    phase's own interval, ``"step"``: one decode step's host issue). Top: the whole run, one lane per stage, bars
    hatched in prefill, solid in decode, the phases shaded, each lane's busy seconds and share of the wall time at
    the right. Bottom: one decode step (the middle one), to see what overlaps. Returns ``path``. Raises PlotError."""
    plt = _pyplot("--timeline")
    from matplotlib.patches import Patch

    from .pipeline.stage_stats import SPAN_LANES

    lanes = list(SPAN_LANES.values())
    work = [s for s in spans if s["stage"] not in ("phase", "step")]
    phases = [s for s in spans if s["stage"] == "phase"]
    steps = [s for s in spans if s["stage"] == "step"]
    end = max([s["end"] for s in spans] or [1.0])
    fig, axes = plt.subplots(2 if steps else 1, 1, figsize=(14, 7.5 if steps else 4.2), squeeze=False)
    ax = axes[0][0]
    _draw_lanes(ax, spans, lanes, 0.0, end * 1.01)
    for y, lane in enumerate(lanes):
        busy = sum(s["end"] - s["start"] for s in work if s["lane"] == lane)
        ax.text(1.005, y, f"{busy:.3g} s busy ({100 * busy / end:.0f}%)", transform=ax.get_yaxis_transform(),
                va="center", fontsize=8)
    for ph in phases:
        ax.text((ph["start"] + ph["end"]) / 2, -0.45, ph["phase"], ha="center", va="top", fontsize=8, zorder=3)
    ax.set_xlabel("wall seconds since the run's first batch")
    ax.set_title(title, fontsize=10)
    handles = [Patch(facecolor=_PHASE_COLORS[p], label=f"{p} (shaded)") for p in ("prefill", "decode")
               if any(ph["phase"] == p for ph in phases)]
    handles += [Patch(facecolor="white", edgecolor="black", hatch="///", label="prefill work (hatched)"),
                Patch(facecolor="tab:gray", label="decode work (solid)")]
    ax.legend(handles=handles, fontsize=7, loc="upper right", bbox_to_anchor=(1.0, -0.14), ncol=4, frameon=False)
    if steps:
        st = steps[len(steps) // 2]
        bx = axes[1][0]
        pad = 0.02 * (st["end"] - st["start"])
        _draw_lanes(bx, spans, lanes, st["start"] - pad, st["end"] + pad)
        bx.set_xlabel("wall seconds since the run's first batch")
        bx.set_title(f"decode step {len(steps) // 2 + 1} of {len(steps)}, zoomed ({1e3 * (st['end'] - st['start']):.1f} ms "
                     f"of host issue)", fontsize=10)
    return _save(plt, fig, path)
