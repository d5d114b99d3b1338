"""CGOPipe on CUDA: tokens equal the serial executor's (fp32 and bf16 greedy, ragged batch), and the
GPU memory cap holds (torch.cuda.max_memory_allocated stays under it). Run on a CUDA host:
``python -m pytest tests/gpu -m gpu``."""


import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.model.spec import MoESpec  # noqa: E402
from lightning_moe.model.weights import dummy_weights, load_checkpoint  # noqa: E402
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor  # noqa: E402
from lightning_moe.pipeline.sampling import DecodeSampling  # noqa: E402
from lightning_moe.pipeline.serial import SerialExecutor  # noqa: E402
from lightning_moe.policy.policy import Policy  # noqa: E402

DT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _prompts(n, seed=0, vocab=32000, maxlen=40):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, maxlen, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


POLICIES = [(3, 4, 0, 0), (3, 4, 3, 1), (11, 1, 0, 0)]  # mu, n, resident experts, GPU-attention micro-batches


@pytest.mark.parametrize("mu,n,resident,gpu_attn", POLICIES)
def test_cgopipe_cuda_equals_serial_fp32(tiny_dir, mu, n, resident, gpu_attn):
    """fp32 greedy: every token equals the serial executor's (ragged batch of 11, 16 steps)."""
    prompts = _prompts(11)
    sp = DecodeSampling(max_new_tokens=16, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cuda").generate(prompts, sp)
    pol = Policy(mu=mu, n=n, prefill_mu=mu, resident_experts=resident, n_gpu_attn=gpu_attn, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cuda")
    out = ex.generate(prompts, sp)
    ex.close()
    mism = [(i, a, b) for i, ((a, _), (b, _)) in enumerate(zip(out, ref)) if a != b]
    assert not mism, f"{len(mism)} of {len(prompts)} sequences differ, first: {mism[0]}"


def test_cgopipe_cuda_equals_serial_bf16_same_shapes(tiny_dir):
    """bf16 greedy, one micro-batch holding the whole batch and one KV group: every attention, GEMM and
    reduction has the serial executor's shapes, so every token is identical."""
    prompts = _prompts(11)
    sp = DecodeSampling(max_new_tokens=16, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(tiny_dir, torch.bfloat16), "cuda").generate(prompts, sp)
    pol = Policy(mu=11, n=1, prefill_mu=11, dtype="bf16", weight_quant="bf16")
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.bfloat16), pol, "cuda", kv_groups=1)
    out = ex.generate(prompts, sp)
    ex.close()
    mism = [(i, a, b) for i, ((a, _), (b, _)) in enumerate(zip(out, ref)) if a != b]
    assert not mism, f"{len(mism)} of {len(prompts)} sequences differ, first: {mism[0]}"


def _serial_logits(ex, prompts, steps, forced=None):
    """Tokens and fp32 logits {(row, step): [V]} of the serial executor (all rows stay alive): greedy, or
    teacher-forced on ``forced[row][step]`` when given."""
    import lightning_moe.pipeline.sampling as S  # DecodeRows.commit: the one place logits become tokens

    got, calls = {}, []

    def record(lg, params, *seed_and_counts):  # sampling.sample(logits, params, seeds, generated counts)
        t = len(calls)
        calls.append(t)
        for r in range(lg.shape[0]):
            got[(r, t)] = lg[r].float().cpu()
        if forced is not None:
            return torch.tensor([forced[r][t] for r in range(lg.shape[0])])
        return lg.float().cpu().argmax(-1)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "sample", record)
        out = ex.generate(prompts, DecodeSampling(max_new_tokens=steps, stop_at_eos=False))
    return [o for o, _ in out], got


def _forced_logits(ex, prompts, forced):
    """Teacher-forced CGOPipe run: each request is fed ``forced[request]`` (the serial executor's tokens) whatever
    its own argmax; returns fp32 logits {(request, step): [V]}. Recorded at DecodeRows.commit, the one place logits
    become tokens, by request index and output position (a refilling executor's rows are slots, not requests)."""
    import lightning_moe.pipeline.sampling as S

    got = {}
    orig = S.DecodeRows.commit

    def commit(self, rows, logits):
        steps = [len(self.outputs[r]) for r in rows]
        for j, (r, t) in enumerate(zip(rows, steps)):
            got[(r, t)] = logits[j].float().cpu()
        with pytest.MonkeyPatch.context() as inner:
            inner.setattr(S, "sample", lambda lg, params, *a: torch.tensor([forced[r][t] for r, t in zip(rows, steps)]))
            return orig(self, rows, logits)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S.DecodeRows, "commit", commit)
        ex.generate(prompts, DecodeSampling(max_new_tokens=len(forced[0]), stop_at_eos=False))
    return got


BF16_REL = 2e-2  # bf16 tolerance: max |logit difference| of a row <= BF16_REL * max |logit| of the serial row
BF16_PCTL = 0.9  # percentile of per-entry relative errors compared with bf16's own (router near-ties are outliers)


@pytest.mark.parametrize("mu,n,resident,gpu_attn", POLICIES)
def test_cgopipe_cuda_matches_serial_bf16(tiny_dir, mu, n, resident, gpu_attn):
    """bf16 with several micro-batches and length-grouped KV: GEMMs and attention run over other batch
    shapes and padded lengths than in the serial executor, so bf16 rounding differs and exact token
    equality is not a property of the math. Checked instead, teacher-forced on the serial executor's
    greedy tokens so both see the same inputs at all 16 steps of 11 ragged rows:
    (1) the mean |logit difference| to the serial bf16 run is at most that of the same run in fp32
        (the pipeline adds less error than bf16 itself; a misplaced KV row or expert gives O(1) errors);
    (2) the BF16_PCTL percentile of the per-(row, step) relative errors (max |dlogit| / max |logit|) is at
        most that of bf16 against fp32 (the tail above it: a router near-tie picked another expert, a
        discontinuity of top-k routing, not of the pipeline).
    (A first version required 97% of entries within 2e-2, calibrated on the CPU; on the H200 the GPU-
    attention policy gave 89.2% with a mean error 0.42x bf16's own, so the bound is now bf16's own error.)"""
    prompts = _prompts(11)
    ser = SerialExecutor(load_checkpoint(tiny_dir, torch.bfloat16), "cuda")
    tokens, ref = _serial_logits(ser, prompts, 16)
    pol = Policy(mu=mu, n=n, prefill_mu=mu, resident_experts=resident, n_gpu_attn=gpu_attn, dtype="bf16", weight_quant="bf16")
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.bfloat16), pol, "cuda")
    got = _forced_logits(ex, prompts, tokens)
    ex.close()
    # the serial executor in fp32, teacher-forced on the same tokens: bf16's own error
    _, f32 = _serial_logits(SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cuda"), prompts, 16, forced=tokens)
    assert set(got) == set(ref) == set(f32) and len(ref) == 11 * 16
    mean_pipe = sum(float((ref[k] - got[k]).abs().mean()) for k in ref) / len(ref)
    mean_bf16 = sum(float((ref[k] - f32[k]).abs().mean()) for k in ref) / len(ref)
    rel = sorted(float((ref[k] - got[k]).abs().max() / ref[k].abs().max()) for k in ref)
    rel16 = sorted(float((ref[k] - f32[k]).abs().max() / ref[k].abs().max()) for k in ref)
    i = int(BF16_PCTL * (len(rel) - 1))
    print(f"mean |dlogit| pipeline {mean_pipe:.2e} vs bf16-fp32 {mean_bf16:.2e}; p{BF16_PCTL * 100:.0f} relative "
          f"{rel[i]:.2e} vs {rel16[i]:.2e}; within {BF16_REL}: {sum(r <= BF16_REL for r in rel) / len(rel):.1%}; max {rel[-1]:.2e}")
    assert mean_pipe <= mean_bf16, f"pipeline error {mean_pipe:.3e} exceeds the bf16 error itself {mean_bf16:.3e}"
    assert rel[i] <= rel16[i], f"p{BF16_PCTL * 100:.0f} relative error {rel[i]:.3e} exceeds bf16's own {rel16[i]:.3e}"


def _run_under_cap(w, pol, prompts, cap, ffn):
    """Run ``prompts`` in batches of pol.N with torch's per-process fraction set to ``cap`` bytes above what the
    allocator already holds (an overrun is an OOM). Returns (outputs, executor stats, scratch bytes, peak bytes:
    the most allocated above what was allocated before, which the tests hold to the cap and the estimate).

    The fraction limits the allocator's reserved segments, not its allocated bytes: segments that earlier tests'
    live tensors keep partly used stay reserved after empty_cache, so the limit counts from memory_reserved (from
    memory_allocated it left this run cap minus that slack, and the tests failed after other tests of the file ran
    and passed alone: the GPU host, session 41)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + cap) / total))
    try:
        torch.cuda.reset_peak_memory_stats()
        ex = CGOPipeExecutor(w, pol, "cuda", ffn=ffn)
        scratch = sum(t.numel() * t.element_size() for t in (getattr(ex.expert_ffn, "scratch", None) or ()))
        out = []
        for i in range(0, len(prompts), pol.N):
            out += ex.generate(prompts[i : i + pol.N], DecodeSampling(max_new_tokens=8, stop_at_eos=False))
        ex.close()
        peak = torch.cuda.max_memory_allocated() - base
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return out, ex.stats, scratch, peak


@pytest.mark.parametrize("ffn", ["torch", "triton"])
def test_cgopipe_memory_cap_holds(ffn):
    """A model whose experts (0.70 GB bf16) exceed a 0.75 GiB cap runs under the cap with the policy the
    planner chose for that cap: torch's per-process fraction enforces the cap (an overrun is an OOM), and
    the measured peak stays under both the cap and the planner's own GPU estimate for the policy."""
    from lightning_moe.policy.hardware import get_preset
    from lightning_moe.policy.milp import plan
    from lightning_moe.policy.policy import Budgets, Workload

    spec = MoESpec(name="mid", model_type="mixtral", vocab_size=32000, hidden_size=1024, intermediate_size=3584,
                   num_layers=4, num_heads=8, num_kv_heads=2, head_dim=128, num_experts=8, top_k=2,
                   rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=4096)
    w = dummy_weights(spec, torch.bfloat16, seed=0)
    expert_bytes = w.expert_bytes
    cap = 3 * 2**28  # 0.75 GiB
    assert expert_bytes > cap - 2**27
    prompts = _prompts(96, seed=1, maxlen=60)
    lens = [len(p) for p in prompts]
    wl = Workload.from_lengths(lens, 8)
    pol, est = plan(spec, get_preset("h200"), wl, Budgets(gpu_memory=cap, cpu_memory=8 * 2**30, gpu_reserve=2**26))
    assert sum(pol.resident_counts(spec)) < spec.num_layers * spec.num_experts  # some experts are paged
    out, stats, _, peak = _run_under_cap(w, pol, prompts, cap, ffn)
    h2d = stats.h2d_bytes
    assert all(len(o) == 8 for o, _ in out)
    assert h2d > expert_bytes  # pages streamed
    assert peak <= cap, f"peak {peak / 2**20:.0f} MiB > cap {cap / 2**20:.0f} MiB (policy {pol})"
    assert peak <= est.gpu_peak, f"peak {peak / 2**20:.0f} MiB > planner's estimate {est.gpu_peak / 2**20:.0f} MiB (policy {pol})"


def test_cgopipe_int4_triton_memory_cap_holds_with_dequant_scratch():
    """int4 pages with the Triton FFN: 12 layers whose int4 experts (536 MiB) exceed a 576 MiB cap; the planner's
    policy pages some experts (CPU planning gave mu = 4, prefill micro-batches of 4 rows, 7 paged experts in the
    fullest layer), so prefill calls (~120 tokens, T k / E >= 16) take the dequantize-then-dense path into the
    executor's dense scratch (147 MiB, counted by the planner as "dequantized expert scratch"). The measured peak
    stays under the cap and under the planner's estimate."""
    from lightning_moe.model.quantized import QuantExperts
    from lightning_moe.policy.hardware import get_preset
    from lightning_moe.policy.milp import plan
    from lightning_moe.policy.policy import Budgets, Workload

    spec = MoESpec(name="mid", model_type="mixtral", vocab_size=32000, hidden_size=1024, intermediate_size=3584,
                   num_layers=12, num_heads=8, num_kv_heads=2, head_dim=128, num_experts=8, top_k=2,
                   rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=4096)
    w = dummy_weights(spec, torch.bfloat16, seed=0)
    w.experts = [QuantExperts.quantize(e, "int4") for e in w.experts]
    cap = 576 * 2**20
    prompts = _prompts(96, seed=1, maxlen=60)
    wl = Workload.from_lengths([len(p) for p in prompts], 8)
    pol, est = plan(spec, get_preset("h200"), wl, Budgets(gpu_memory=cap, cpu_memory=8 * 2**30, gpu_reserve=2**26,
                                                            weight_quant="int4"))
    assert sum(pol.resident_counts(spec)) < spec.num_layers * spec.num_experts  # some experts are paged
    assert est.memory.gpu_prefill["dequantized expert scratch"] > 0
    out, _, scratch, peak = _run_under_cap(w, pol, prompts, cap, "triton")
    assert all(len(o) == 8 for o, _ in out)
    assert scratch <= est.memory.gpu_prefill["dequantized expert scratch"]
    assert peak <= cap, f"peak {peak / 2**20:.0f} MiB > cap {cap / 2**20:.0f} MiB (policy {pol})"
    assert peak <= est.gpu_peak, f"peak {peak / 2**20:.0f} MiB > planner's estimate {est.gpu_peak / 2**20:.0f} MiB (policy {pol})"


@pytest.mark.parametrize("h2d", ["kernel", "dma"])
@pytest.mark.parametrize("mu,n,gpu_attn", [(3, 4, 0), (3, 4, 1), (4, 2, 1)])
def test_layer_lookahead_tokens_equal_the_schedule_without_it_bf16(tiny_dir, h2d, mu, n, gpu_attn):
    """On CUDA (a real worker thread, the d2h / attention-h2d / weight streams, the pinned output buffer each CPU
    micro-batch rewrites every layer): CGOPipe's layer look-ahead gives the tokens of the schedule without it, bit for
    bit (bf16 greedy, 24 steps, 15 prompts through N = 8 or 12 slots: refills), with attention outputs by the
    zero-copy kernel and by DMA, with and without a GPU-attention micro-batch."""
    from lightning_moe.kernels.host_read import host_read_available

    if h2d == "kernel" and not host_read_available(torch.device("cuda")):
        pytest.skip("this device cannot read pinned host memory from a kernel")
    prompts = _prompts(15, seed=4)
    sp = DecodeSampling(max_new_tokens=24, stop_at_eos=False)
    pol = Policy(mu=mu, n=n, prefill_mu=mu, resident_experts=2, n_gpu_attn=gpu_attn, dtype="bf16", weight_quant="bf16")
    outs = []
    for ahead in (False, True):
        ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.bfloat16), pol, "cuda", layer_lookahead=ahead,
                             attention_h2d=h2d)
        try:
            outs.append([o for o, _ in ex.generate(prompts, sp)])
        finally:
            ex.close()
    mism = [i for i, (a, b) in enumerate(zip(*outs)) if a != b]
    assert not mism, f"{len(mism)} of {len(prompts)} sequences differ with the look-ahead, first: {mism[0]}"


def test_an_exception_mid_step_reaches_the_caller_and_close_joins_the_worker(tiny_dir):
    """A failure inside a decode step, after the look-ahead has queued CPU attentions of the next layer on the worker
    thread: the exception reaches the caller, ``close()`` returns with the worker thread joined (it neither hangs on
    a queued attention nor leaves the thread running), and a new executor on the same weights then gives the tokens
    of a run that never failed (bf16 greedy, one GPU-attention micro-batch)."""
    import threading

    prompts = _prompts(15, seed=5)
    sp = DecodeSampling(max_new_tokens=12, stop_at_eos=False)
    pol = Policy(mu=3, n=4, prefill_mu=3, resident_experts=2, n_gpu_attn=1, dtype="bf16", weight_quant="bf16")
    w = load_checkpoint(tiny_dir, torch.bfloat16)

    def run():
        ex = CGOPipeExecutor(w, pol, "cuda")
        try:
            return [o for o, _ in ex.generate(prompts, sp)]
        finally:
            ex.close()

    clean = run()
    ex = CGOPipeExecutor(w, pol, "cuda")
    finish, seen = ex._finish_micro_batch, {"decode": 0}

    def failing(l, visit, slots, k, mb, attn, ffn):  # micro-batch 1 at layer 2 of the second decode step
        if ex.phase == "decode":
            seen["decode"] += 1
            if seen["decode"] == (w.spec.num_layers + 2) * slots + 2:
                raise RuntimeError("injected mid-step")
        return finish(l, visit, slots, k, mb, attn, ffn)

    ex._finish_micro_batch = failing
    with pytest.raises(RuntimeError, match="injected mid-step"):
        ex.generate(prompts, sp)
    assert ex.attention.workers is not None
    worker_threads = list(ex.attention.workers._threads)
    assert worker_threads, "the worker never started"
    closer = threading.Thread(target=ex.close, daemon=True)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive(), "close() hung after a failed decode step"
    assert not any(t.is_alive() for t in worker_threads), "close() left the CPU attention worker running"
    assert run() == clean
