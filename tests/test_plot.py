"""``moe-batch plan --plot``: the roofline points' intensities and heights by hand, and the PNG is written."""

import os
import subprocess
import sys

import pytest

from lightning_moe.model.spec import dtype_bytes
from lightning_moe.plot import roofline_points
from lightning_moe.policy.hardware import get_preset
from lightning_moe.policy.hrm import active_experts
from lightning_moe.policy.policy import Policy, Workload
from lightning_moe.policy.registry import resolve_spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _case():
    spec, hw = resolve_spec("mixtral-8x7b"), get_preset("l4")
    policy = Policy(mu=48, n=5, prefill_mu=48, n_gpu_attn=2, resident_experts=3)
    return spec, hw, policy, Workload(prompt_len=77, gen_len=33, num_requests=200)


def test_points_by_hand():
    spec, hw, policy, wl = _case()
    pts = {p["label"].split(" (")[0] + ("" if "PCIe" not in p["label"] else " PCIe"): p
           for p in roofline_points(spec, hw, policy, wl)}
    b = dtype_bytes(policy.dtype)
    ctx = 77 + 33 / 2
    i_attn = 4 * spec.attn_query_elems * ctx / (ctx * spec.kv_elems_per_token * b)  # = 4 q / (kv b): 4096*4/(2048*2)
    assert i_attn == pytest.approx(4.0)
    cpu = pts["decode attention, CPU"]
    assert cpu["intensity"] == pytest.approx(i_attn)
    assert cpu["flops_per_s"] == pytest.approx(min(hw.cpu_attention_flops, i_attn * hw.cpu_attention_bandwidth))
    assert pts["decode attention, GPU"]["flops_per_s"] == pytest.approx(min(hw.gpu_flops("bf16"), i_attn * hw.gpu_hbm_bandwidth))
    N = min(policy.N, 200)  # 240 capped by the job's 200 requests
    resident = [c for i, c in enumerate(policy.resident_counts(spec)) if i >= spec.num_dense_layers]
    paged = spec.num_experts - sum(resident) / len(resident)
    We = spec.expert_bytes("bf16")
    dec = pts["expert FFN, decode PCIe"]
    assert dec["intensity"] == pytest.approx(2 * N * spec.top_k * spec.expert_params / (paged * We))
    mb = pts["expert FFN, decode micro-batch"]
    assert mb["intensity"] == pytest.approx(2 * 48 * 2 * spec.expert_params / (active_experts(48, 8, 2) * We))
    pre = pts["expert FFN, prefill PCIe"]
    assert pre["intensity"] == pytest.approx(2 * N * 77 * 2 * spec.expert_params / (paged * We))
    assert pre["flops_per_s"] <= hw.gpu_flops("bf16")


def test_scoring_has_no_decode_points():
    spec, hw, policy, _ = _case()
    wl = Workload(prompt_len=300, gen_len=1, num_requests=100, scoring=True)
    labels = [p["label"] for p in roofline_points(spec, hw, policy, wl)]
    assert labels and all("decode" not in s for s in labels), labels


def test_plan_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "roof.png"
    p = subprocess.run([sys.executable, "-m", "lightning_moe.cli", "plan", "--model", "mixtral-8x7b", "--hardware", "l4",
                        "--gpu-memory", "24GiB", "--cpu-memory", "192GiB", "--prompt-len", "77", "--gen-len", "32",
                        "--plot", str(out)], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO),
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "roofline drawn to" in p.stdout
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 20_000


def test_unwritable_path_is_a_plot_error_and_closes_the_figure(tmp_path):
    """Both drawings save through one place: a path that cannot be written is a PlotError naming it, and the figure is
    closed either way (no figure left open in a long-running process)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from lightning_moe.plot import PlotError, save_plan_plot, save_timeline
    from lightning_moe.policy.hrm import evaluate

    spec, hw, policy, wl = _case()
    bad = str(tmp_path / "no-such-dir" / "x.png")
    spans = [{"stage": "phase", "lane": "", "phase": "prefill", "start": 0.0, "end": 1.0},
             {"stage": "h2d", "lane": "H2D expert pages", "phase": "prefill", "start": 0.1, "end": 0.5}]
    for draw in (lambda p: save_plan_plot(p, spec, hw, policy, wl, evaluate(policy, spec, hw, wl)),
                 lambda p: save_timeline(p, spans, "run")):
        with pytest.raises(PlotError, match="cannot write .*no-such-dir"):
            draw(bad)
        assert plt.get_fignums() == []
        ok = tmp_path / "ok.png"
        assert draw(str(ok)) == str(ok) and ok.stat().st_size > 0
        assert plt.get_fignums() == []
