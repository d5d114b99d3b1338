"""CGOPipe over quantized checkpoints on the CPU: packed pages are paged and dequantized on the device.

The pool, page buffers and resident experts hold one ``uint8 [page_bytes]`` packed page per expert, so
h2d bytes are packed bytes; tokens equal the serial executor's (which dequantizes the same pages the same
way), on the embedded tiny-mixtral (fp32, D=64, F=128, 8 experts, 4 layers).
"""

import pytest
import torch
from tests.support.hf_checkpoints import assert_scores_match

from lightning_moe.kernels.fused_moe import triton_available
from lightning_moe.model.quantize import quantize_checkpoint
from lightning_moe.model.quantized import QuantExperts
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.expert_ffn import expert_ffn
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor
from lightning_moe.policy.policy import Policy

SCHEMES = {"int4": dict(experts="int4"), "int2-up": dict(experts="int4", up="int2")}
PAGE_BYTES = {"int4": 16384, "int2-up": 12288}  # tiny-mixtral, G = 128 (as in test_quantize.py)


@pytest.fixture(scope="module")
def qdirs(tiny_dir, tmp_path_factory):
    """{scheme: quantized copy of tiny-mixtral} for int4 and int2-up."""
    root = tmp_path_factory.mktemp("cgopipe-quant")
    return {s: quantize_checkpoint(tiny_dir, str(root / s), **kw).dst for s, kw in SCHEMES.items()}


def _prompts(n, seed=0, vocab=32000):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


@pytest.mark.parametrize("resident", [0, 3])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_cgopipe_quant_cpu_equals_serial_and_moves_packed_bytes(qdirs, scheme, resident):
    """Ragged batch of 11 prompts, 12 new tokens, 4 micro-batches: serial's tokens exactly; the pool,
    resident experts and h2d traffic are packed pages."""
    d = qdirs[scheme]
    prompts = _prompts(11)
    sp = DecodeSampling(max_new_tokens=12, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(d, torch.float32), "cpu", torch.float32).generate(prompts, sp)

    w = load_checkpoint(d, torch.float32)
    assert all(isinstance(e, QuantExperts) for e in w.experts)
    L, E, pb = w.spec.num_layers, w.spec.num_experts, PAGE_BYTES[scheme]
    assert w.experts[0].layout.page_bytes == pb
    pol = Policy(mu=3, n=4, prefill_mu=2, resident_experts=resident, dtype="fp32", weight_quant=scheme)
    ex = CGOPipeExecutor(w, pol, "cpu")
    assert len(ex._micro_batches(prompts, 0, False, pol.mu)) == 4
    out = ex.generate(prompts, sp)
    ex.close()
    assert [o for o, _ in out] == [o for o, _ in ref]
    assert ex.stats.decode_steps == 11
    summary = ex.policy_summary()
    assert summary["expert_pages"] == scheme and summary["host_pool_bytes"] == ex.weight_stream.pool.nbytes

    # packed pages everywhere: pool entry "page" uint8 [experts_per_page, pb]
    epp = ex.weight_stream.paging.experts_per_page
    assert [(e.name, e.dtype, e.shape) for e in ex.weight_stream.pool.layout.entries] == [("page", torch.uint8, (epp, pb))]
    assert ex.weight_stream.pool.layout.page_bytes == epp * pb  # pb is a multiple of the pager's 256-byte alignment
    n_paged = L * (E - resident)
    assert sum(ex.weight_stream.pool.pages_per_layer) * epp >= n_paged  # last page of a layer may be partly padding
    assert ex.weight_stream.pool.nbytes == sum(ex.weight_stream.pool.pages_per_layer) * epp * pb
    if resident == 0:
        assert ex.weight_stream.pool.nbytes == n_paged * pb
    assert ex.weight_stream.resident.nbytes == L * resident * pb
    assert ex.weight_stream.buffers.nbytes == 2 * ex.weight_stream.pool.max_pages_per_layer * epp * pb
    # every layer visit (prefill + 11 decode steps, + the prefetch of the next step's layer 0) copies its
    # layer's pages as packed bytes (pb per expert slot, < 1/5 of a dense fp32 expert)
    visits = L * (1 + ex.stats.decode_steps) + 1
    slots = sum(ex.weight_stream.pool.pages_per_layer[v % L] * epp for v in range(visits))
    assert ex.stats.h2d_bytes == slots * pb
    assert pb < 3 * w.spec.hidden_size * w.spec.intermediate_size * 4 / 5


def test_cgopipe_quant_prompt_logprobs_equal_serial(qdirs):
    """Scoring (prefill only) over packed pages with resident experts: serial's log-probs and greedy ids."""
    seqs = [s + [5, 6] for s in _prompts(5, seed=2)]
    d = qdirs["int2-up"]
    ref = SerialExecutor(load_checkpoint(d, torch.float32), "cpu").prompt_logprobs(seqs)
    ex = CGOPipeExecutor(load_checkpoint(d, torch.float32),
                         Policy(mu=2, n=3, prefill_mu=2, resident_experts=2, dtype="fp32", weight_quant="int2-up"), "cpu")
    out = ex.prompt_logprobs(seqs)
    ex.close()
    assert_scores_match(out, ref)  # prefill chunks differ: as the dense test


def test_cgopipe_rejects_mixed_dense_and_packed_layers(qdirs, tiny_dir):
    w = load_checkpoint(qdirs["int4"], torch.float32)
    w.experts[1] = load_checkpoint(tiny_dir, torch.float32).experts[1]
    with pytest.raises(ValueError, match="packed pages of one layout"):
        CGOPipeExecutor(w, Policy(mu=2, n=2, prefill_mu=2, dtype="fp32", weight_quant="int4"), "cpu")


def test_policy_for_job_uses_the_checkpoint_scheme(qdirs, tiny_dir):
    """An explicit policy mapping without weight_quant gets the checkpoint's scheme (dense: the dtype)."""
    from types import SimpleNamespace

    from lightning_moe.app.plan import policy_for_job

    job = SimpleNamespace(dtype="float32", policy={"mu": 2, "n": 2})
    assert policy_for_job(job, SimpleNamespace(model_path=qdirs["int4"]))[0].weight_quant == "int4"
    assert policy_for_job(job, SimpleNamespace(model_path=qdirs["int2-up"]))[0].weight_quant == "int2-up"
    assert policy_for_job(job, SimpleNamespace(model_path=tiny_dir))[0].weight_quant == "fp32"


@pytest.fixture
def interpret(monkeypatch):
    """Triton's CPU interpreter (triton imported first, in compiled mode: see tests/test_quant.py)."""
    if not triton_available():
        pytest.skip("triton not installed")  # the wording of every triton skip (tests/test_fresh_user.py checks it)
    import triton  # noqa: F401
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _triton_ffn(ex):
    """The "triton" expert FFN strategy over ``ex``'s weight stream (the executor picks it on CUDA only)."""
    ws = ex.weight_stream
    return expert_ffn("triton", ex.family.experts_ffn_from, ws.paging, ws.page_layout, ex.spec.num_experts, ex.dtype,
                      ex.device)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecation inside the interpreter
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_triton_ffn_over_paged_and_resident_pages_interpreted(qdirs, interpret, scheme):
    """The "triton" expert FFN over packed pages (CUDA-only in the executor; here the strategy under the
    interpreter): the layer's paged and resident experts, dequantized into one scratch, through one dense grouped
    kernel, equal the per-expert dequantizing reference (fp32, 1e-5)."""
    ex = CGOPipeExecutor(load_checkpoint(qdirs[scheme], torch.float32),
                         Policy(mu=2, n=3, prefill_mu=2, resident_experts=3, dtype="fp32", weight_quant=scheme), "cpu")
    visit = ex.weight_stream.begin_visit()
    lx = ex.weight_stream.wait_pages(visit)
    assert lx.paged["page"].shape == (5, PAGE_BYTES[scheme]) and lx.resident["page"].shape == (3, PAGE_BYTES[scheme])
    g = torch.Generator().manual_seed(3)
    T, D, E = 9, ex.spec.hidden_size, ex.spec.num_experts
    h = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])  # both groups hit
    w = torch.softmax(torch.randn(T, 2, generator=g), -1)
    got = _triton_ffn(ex).for_visit(lx)(h, None, w, ids)
    want = ex.expert_ffn.for_visit(lx)(h, None, w, ids)
    ex.weight_stream.end_visit(visit)
    ex.close()
    assert (got - want).norm() / want.norm() <= 1e-5


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_triton_ffn_dequantizes_experts_once_per_visit_interpreted(qdirs, interpret, monkeypatch, scheme):
    """The "triton" FFN over packed pages (interpreted): within one layer visit all the layer's experts are
    dequantized once, by its first call: the 5 paged ones to rows 0-4 and the 3 resident ones to rows 5-7 of the
    strategy's scratch [8, ...] (two dequantize calls); later calls of any size reuse it; a new visit dequantizes
    again into the same scratch. Every call (1, 70, 5 with an expert given no tokens, 64 tokens) equals the
    per-expert dequantizing reference (fp32, 1e-5)."""
    from lightning_moe.kernels import quant as Q

    ex = CGOPipeExecutor(load_checkpoint(qdirs[scheme], torch.float32),
                         Policy(mu=2, n=3, prefill_mu=2, resident_experts=3, dtype="fp32", weight_quant=scheme), "cpu",
                         ffn="triton")
    tri = _triton_ffn(ex)
    assert tri.scratch is None  # allocated up front on CUDA only (the CPU executor runs the torch FFN)
    calls = []
    real = Q.dequantize_pages_triton
    monkeypatch.setattr(Q, "dequantize_pages_triton", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    visit = ex.weight_stream.begin_visit()
    lx = ex.weight_stream.wait_pages(visit)
    D, F, E = ex.spec.hidden_size, ex.spec.intermediate_size, ex.spec.num_experts
    ffn, ref = tri.for_visit(lx), ex.expert_ffn.for_visit(lx)
    g = torch.Generator().manual_seed(4)
    scratch_ptr = None
    for T in (1, 70, 5, 64):
        h = torch.randn(T, D, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
        if T == 5:
            ids[ids == 6] = 7  # expert 6 (paged) gets no tokens
        w = torch.softmax(torch.randn(T, 2, generator=g), -1)
        got, want = ffn(h, None, w, ids), ref(h, None, w, ids)
        assert (got - want).norm() / want.norm() <= 1e-5, T
        assert len(calls) == 2, (T, calls)
        assert [tuple(t.shape) for t in tri.scratch] == [(8, F, D), (8, F, D), (8, D, F)]
        scratch_ptr = scratch_ptr or tri.scratch[0].data_ptr()
    # the next visit of the layer: a new closure, dequantized again into the same scratch
    ffn2 = tri.for_visit(lx)
    h = torch.randn(80, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(80)])
    w = torch.softmax(torch.randn(80, 2, generator=g), -1)
    got, want = ffn2(h, None, w, ids), ref(h, None, w, ids)
    assert (got - want).norm() / want.norm() <= 1e-5
    assert calls == [(5, PAGE_BYTES[scheme]), (3, PAGE_BYTES[scheme])] * 2 and tri.scratch[0].data_ptr() == scratch_ptr
    ex.weight_stream.end_visit(visit)
    ex.close()


def test_policy_auto_refuses_a_cap_larger_than_the_card(tiny_dir):
    """policy: auto with gpu_memory above the named hardware's GPU memory (or cpu_memory above its host memory) is an
    error before any planning."""
    from types import SimpleNamespace

    from lightning_moe.app.plan import policy_for_job

    job = SimpleNamespace(device="cuda", task="generate", dtype="float32", policy="auto", hardware="t4", gpu_memory=16 << 30, cpu_memory=None)
    with pytest.raises(ValueError, match="gpu_memory 16.0 GiB exceeds the 15.0 GiB of GPU memory of hardware 't4'"):
        policy_for_job(job, SimpleNamespace(model_path=tiny_dir))
    job = SimpleNamespace(device="cuda", task="generate", dtype="float32", policy="auto", hardware="h200", gpu_memory=None, cpu_memory=200 << 30)
    with pytest.raises(ValueError, match="cpu_memory 200.0 GiB exceeds the 128.0 GiB of host memory of hardware 'h200'"):
        policy_for_job(job, SimpleNamespace(model_path=tiny_dir))
    job = SimpleNamespace(device="cuda", task="generate", dtype="float32", policy="auto", hardware="h200", gpu_memory=None, cpu_memory=200 << 30,
                          config_path="/jobs/nightly.yaml")
    with pytest.raises(ValueError, match=r"^/jobs/nightly\.yaml: cpu_memory 200\.0 GiB exceeds"):  # names the job file
        policy_for_job(job, SimpleNamespace(model_path=tiny_dir))
