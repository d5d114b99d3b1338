"""kernels.norm_rope (RMSNorm and rotate-half RoPE in one Triton launch each) under Triton's CPU interpreter: the
kernels against their torch references (the model's math) on awkward shapes, strided inputs and three dtypes, the
operand checks, and model.layers' dispatch between the two paths.

Tolerances. RoPE: bitwise (torch.equal) in fp32, bf16 and fp16: the kernel rounds each product and the sum to x's
dtype as torch's element-wise ops do. RMSNorm: the fp32 sum of squares is added up in another order than torch's,
so the fp32 statistic differs by a few fp32 ulps: fp32 output within 1e-6 relative; in bf16 / fp16 that can flip the
rounding of the normalized value to x's dtype by one unit in the last place (1 ulp: ``assert_close`` with
``rtol = eps`` of the dtype, ``atol`` one subnormal ulp), and the product with the weight, rounded once more, can
then differ by 2 ulps (``rtol = 2 eps``). Checked both ways: weight 1 (the output is the normalized value: 1 ulp)
and a random weight (2 ulps). The CUDA runs are in tests/gpu/test_norm_rope_gpu.py.
"""

from types import SimpleNamespace

import pytest
import torch

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels import norm_rope as nr
from lightning_moe.model import layers as L

needs_triton = pytest.mark.skipif(not fm.triton_available(), reason="triton not installed")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def interpret(monkeypatch):
    """Triton's CPU interpreter (triton imported first in compiled mode, as tests/test_kernels_ref.py explains)."""
    import triton  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")


def assert_rms_close(got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    """fp32: 1e-6 relative; bf16 / fp16: within ``ulps`` units in the last place (rtol = ulps * eps, atol = ulps
    subnormal ulps, so values near zero are held to the same count), and at most 1% of the elements (or 1) not
    bitwise equal (a flipped rounding is rare; a kernel that skipped the rounding of the normalized value to x's dtype
    would stay within 2 ulps but differ in ~10-40% of the elements)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    else:
        fi = torch.finfo(got.dtype)
        torch.testing.assert_close(got, want, rtol=ulps * fi.eps, atol=ulps * fi.eps * fi.tiny)
        n = int((got != want).sum())
        assert n <= max(1, got.numel() // 100), f"{n} of {got.numel()} elements differ"


def rms_inputs(shape, dtype, seed):
    torch.manual_seed(seed)
    x = (torch.randn(*shape) * 3 + 0.5).to(dtype)  # [..., D], off-centre so the mean of squares is not ~1
    w = (torch.randn(shape[-1]) * 0.5 + 1).to(dtype)  # [D]
    return x, w


# --------------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("D", [64, 96, 2880])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(interpret, seed, T, D, dtype):
    x, w = rms_inputs((T, D), dtype, seed=seed * 1000 + T * D)
    eps = 1e-5
    assert_rms_close(nr.rms_norm_triton(x, w, eps), nr.rms_norm_torch(x, w, eps), ulps=2)
    ones = torch.ones(D, dtype=dtype)
    assert_rms_close(nr.rms_norm_triton(x, ones, eps), nr.rms_norm_torch(x, ones, eps), ulps=1)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_eps_matters(interpret, dtype):
    """Rows of tiny values, where eps dominates the mean of squares (a kernel that drops eps fails here)."""
    x, w = rms_inputs((5, 96), dtype, seed=7)
    x = x * 1e-3
    for eps in (1e-6, 1e-2):
        assert_rms_close(nr.rms_norm_triton(x, w, eps), nr.rms_norm_torch(x, w, eps), ulps=2)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [2, 3])
def test_rms_norm_leading_shapes_and_strided_rows(interpret, dtype, seed):
    """[T, H, hd] per-head norms (Qwen3's q / k norm), rows of a split (DeepSeek's latent c), the leading dims
    flattened to rows; the output is a new contiguous tensor of x's shape."""
    torch.manual_seed(seed)
    T, H, hd = 7, 3, 80
    x, w = rms_inputs((T, H, hd), dtype, seed)
    got = nr.rms_norm_triton(x, w, 1e-6)
    assert got.shape == x.shape and got.is_contiguous()
    assert_rms_close(got, nr.rms_norm_torch(x, w, 1e-6), ulps=2)
    wide = (torch.randn(33, 96 + 64) * 2).to(dtype)
    c, _ = wide.split([96, 64], dim=-1)  # [33, 96] rows at stride 160
    wc = (torch.randn(96) + 1).to(dtype)
    assert c.stride() == (160, 1)
    assert_rms_close(nr.rms_norm_triton(c, wc, 1e-6), nr.rms_norm_torch(c, wc, 1e-6), ulps=2)
    xt = (torch.randn(4, 9, 64) * 2).to(dtype).transpose(0, 1)  # [9, 4, 64]: leading dims that do not flatten
    w64 = (torch.randn(64) + 1).to(dtype)
    assert_rms_close(nr.rms_norm_triton(xt, w64, 1e-6), nr.rms_norm_torch(xt, w64, 1e-6), ulps=2)


@needs_triton
def test_rms_norm_no_rows(interpret):
    x, w = torch.empty(0, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    assert nr.rms_norm_triton(x, w, 1e-6).shape == (0, 64)


# --------------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------------


def rope_inputs(T, H, hd, dtype, seed, layout):
    """x [T, H, hd] in ``layout``: "contiguous", "slice" (the last hd of a wider head, as DeepSeek's q[..., nope:]),
    "heads" (every other head of a wider tensor: a head stride of 2 hd); cos / sin [T, hd] random."""
    torch.manual_seed(seed)
    if layout == "contiguous":
        x = torch.randn(T, H * hd).to(dtype).view(T, H, hd)  # a projection's output viewed as heads
    elif layout == "slice":
        x = torch.randn(T, H, hd + 48).to(dtype)[..., 48:]
    else:
        x = torch.randn(T, 2 * H, hd).to(dtype)[:, ::2]
    cos, sin = torch.randn(T, hd).to(dtype), torch.randn(T, hd).to(dtype)
    return x, cos, sin


@needs_triton
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("H", [1, 3, 8])
@pytest.mark.parametrize("hd", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_bitwise(interpret, seed, T, H, hd, dtype):
    layout = ("contiguous", "slice", "heads")[(seed + T + H) % 3]
    x, cos, sin = rope_inputs(T, H, hd, dtype, seed * 1000 + T * H + hd, layout)
    got = nr.apply_rope_triton(x, cos, sin)
    assert got.shape == (T, H, hd) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, nr.apply_rope_torch(x, cos, sin))


@needs_triton
@pytest.mark.parametrize("layout", ["contiguous", "slice", "heads"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_bitwise_every_layout(interpret, layout, dtype):
    x, cos, sin = rope_inputs(7, 3, 80, dtype, seed=11, layout=layout)
    assert torch.equal(nr.apply_rope_triton(x, cos, sin), nr.apply_rope_torch(x, cos, sin))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_bitwise_model_tables(interpret, dtype):
    """The tables of layers.rope_cos_sin (positions up to 32k, attention factor 1) and row slices of them, as the
    executors pass one chunk's rows; a one-head [T, 1, rd] view of a split (DeepSeek's k_pe[:, None, :])."""
    spec = SimpleNamespace(rope_attention_factor=1.0)
    hd, T = 128, 33
    torch.manual_seed(5)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, hd, 2).float() / hd))
    positions = torch.randint(0, 32768, (2 * T,))
    cos, sin = L.rope_cos_sin(spec, positions, inv_freq, dtype)
    cos, sin = cos[T:], sin[T:]  # row slices
    x = torch.randn(T, 8 * hd).to(dtype).view(T, 8, hd)
    assert torch.equal(nr.apply_rope_triton(x, cos, sin), nr.apply_rope_torch(x, cos, sin))
    c, k_pe = torch.randn(T, 96 + hd).to(dtype).split([96, hd], dim=-1)
    k = k_pe[:, None, :]  # [T, 1, hd] strides (224, ?, 1)
    assert torch.equal(nr.apply_rope_triton(k, cos, sin), nr.apply_rope_torch(k, cos, sin))


@needs_triton
def test_rope_no_tokens(interpret):
    x = torch.empty(0, 4, 64, dtype=torch.bfloat16)
    c = torch.empty(0, 64, dtype=torch.bfloat16)
    assert nr.apply_rope_triton(x, c, c).shape == (0, 4, 64)


# --------------------------------------------------------------------------------------------------
# Operand checks and dispatch
# --------------------------------------------------------------------------------------------------


def test_rms_norm_unsupported_reasons():
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    assert nr.rms_norm_triton_unsupported(x, w) is None
    assert "weight dtype" in nr.rms_norm_triton_unsupported(x, w.float())  # gpt-oss: fp32 weight, bf16 x
    assert "dtype" in nr.rms_norm_triton_unsupported(x.double(), w.double())
    assert "weight [D]" in nr.rms_norm_triton_unsupported(x, w[:32])
    assert "contiguous" in nr.rms_norm_triton_unsupported(torch.randn(64, 4).to(torch.bfloat16).t(), w)
    xg = torch.randn(4, 64, requires_grad=True)
    assert "autograd" in nr.rms_norm_triton_unsupported(xg, torch.ones(64))
    with torch.no_grad():
        assert nr.rms_norm_triton_unsupported(xg, torch.ones(64)) is None


def test_rope_unsupported_reasons():
    x = torch.randn(5, 2, 64, dtype=torch.bfloat16)
    c = torch.randn(5, 64, dtype=torch.bfloat16)
    assert nr.apply_rope_triton_unsupported(x, c, c) is None
    assert "hd even" in nr.apply_rope_triton_unsupported(torch.randn(5, 2, 63), c.float()[:, :63], c.float()[:, :63])
    assert "hd even" in nr.apply_rope_triton_unsupported(x[0], c, c)  # not [T, H, hd]
    assert "no broadcasting" in nr.apply_rope_triton_unsupported(x, c[:1], c[:1])
    assert "cos dtype" in nr.apply_rope_triton_unsupported(x, c.float(), c)
    assert "sin dtype" in nr.apply_rope_triton_unsupported(x, c, c.float())
    assert "dtype" in nr.apply_rope_triton_unsupported(x.double(), c.double(), c.double())
    xs = torch.randn(5, 2, 128, dtype=torch.bfloat16)[..., ::2]
    assert "not contiguous" in nr.apply_rope_triton_unsupported(xs, c, c)
    assert "not contiguous" in nr.apply_rope_triton_unsupported(x, torch.randn(64, 5).to(torch.bfloat16).t(), c)


@needs_triton
def test_wrappers_refuse_what_they_cannot_take(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        nr.rms_norm_triton(x, w, 1e-6)
    with pytest.raises(ValueError, match="weight dtype"):
        nr.rms_norm_triton(x, w.float(), 1e-6)
    xr, c = x.view(4, 1, 64), torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        nr.apply_rope_triton(xr, c, c)
    with pytest.raises(ValueError, match="no broadcasting"):
        nr.apply_rope_triton(xr, c[:1], c[:1])


def test_dispatch_predicates_on_cpu():
    """CPU tensors never take the kernels (the interpreter is never chosen automatically); a CUDA tensor does when
    triton imports (the device test is use_triton's: checked with a stand-in object, there is no CUDA here)."""
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    c = torch.randn(4, 64, dtype=torch.bfloat16)
    assert not nr.use_triton(x)
    assert not nr.rms_norm_uses_triton(x, w)
    assert not nr.apply_rope_uses_triton(x.view(4, 1, 64), c, c)
    assert nr.use_triton(SimpleNamespace(is_cuda=True)) == fm.triton_available()
    assert not nr.use_triton(SimpleNamespace(is_cuda=False))


@needs_triton
def test_layers_dispatch_to_the_kernels(interpret, monkeypatch):
    """With use_triton saying yes (what it says for a CUDA tensor), layers.rms_norm / apply_rope call the Triton
    wrappers when the operands are supported (here run by the interpreter) and the torch references otherwise."""
    calls = []

    def spy(name):
        real = getattr(nr, name)

        def wrapped(*a, **k):
            calls.append(name)
            return real(*a, **k)
        monkeypatch.setattr(nr, name, wrapped)

    for name in ("rms_norm_triton", "rms_norm_torch", "apply_rope_triton", "apply_rope_torch"):
        spy(name)
    monkeypatch.setattr(nr, "use_triton", lambda x: True)
    x, w = rms_inputs((7, 96), torch.bfloat16, seed=3)
    assert_rms_close(L.rms_norm(x, w, 1e-5), nr.rms_norm_torch(x, w, 1e-5), ulps=2)
    assert calls[:1] == ["rms_norm_triton"]
    calls.clear()
    L.rms_norm(x, w.float(), 1e-5)  # mixed dtypes: torch path (torch's promotion)
    assert calls == ["rms_norm_torch"]
    calls.clear()
    q, cos, sin = rope_inputs(7, 3, 64, torch.bfloat16, seed=4, layout="slice")
    assert torch.equal(L.apply_rope(q, cos, sin), nr.apply_rope_torch(q, cos, sin))
    assert calls[:1] == ["apply_rope_triton"]
    calls.clear()
    L.apply_rope(q, cos.float(), sin.float())  # fp32 tables with a bf16 x: the torch path (torch's promotion)
    assert calls == ["apply_rope_torch"]


def test_layers_cpu_path_is_the_torch_reference():
    """On the CPU layers.rms_norm / apply_rope are the torch references, bit for bit (every CPU test of the model)."""
    x, w = rms_inputs((7, 96), torch.bfloat16, seed=9)
    assert torch.equal(L.rms_norm(x, w, 1e-5), nr.rms_norm_torch(x, w, 1e-5))
    q, cos, sin = rope_inputs(7, 3, 64, torch.bfloat16, seed=9, layout="heads")
    assert torch.equal(L.apply_rope(q, cos, sin), nr.apply_rope_torch(q, cos, sin))
