"""The pipelined executor on the CPU (synchronous copies) gives exactly the serial executor's tokens."""

import pytest
import torch
from tests.support.hf_checkpoints import assert_scores_match

from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor
from lightning_moe.policy.policy import Policy


def _prompts(n, seed=0, vocab=32000):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


@pytest.mark.parametrize("resident", [0, 3])
def test_cgopipe_cpu_equals_serial_ragged(tiny_dir, resident):
    """Ragged batch of 11 prompts in 4 micro-batches (mu=3), with and without resident experts."""
    prompts = _prompts(11)
    sp = DecodeSampling(max_new_tokens=12, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cpu").generate(prompts, sp)
    pol = Policy(mu=3, n=4, prefill_mu=2, resident_experts=resident, dtype="fp32", weight_quant="fp32")  # prefill in chunks of 2
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu")
    assert len(ex._micro_batches(prompts, 0, False, pol.mu)) == 4  # >= 3 micro-batches
    out = ex.generate(prompts, sp)
    ex.close()
    assert [o for o, _ in out] == [o for o, _ in ref]
    assert ex.weight_stream.pool.nbytes > 0 and ex.stats.decode_steps == 11


def test_cgopipe_cpu_stop_at_eos_and_callbacks(tiny_dir):
    """A stop token that one sequence emits early: same outputs, reasons and callbacks as serial."""
    prompts = _prompts(7, seed=1)
    serial = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cpu")
    free = serial.generate(prompts, DecodeSampling(max_new_tokens=6, stop_at_eos=False))
    eos = free[0][0][2]  # sequence 0 emits this at step 3: use it as the stop token
    sp = DecodeSampling(max_new_tokens=6, stop_at_eos=True)
    ref = serial.generate(prompts, sp, eos_token_id=eos)
    assert ref[0][1] == "stop" and len(ref[0][0]) <= 3
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), Policy(mu=2, n=4, prefill_mu=2, dtype="fp32", weight_quant="fp32"), "cpu")
    seen = {}
    out = ex.generate(prompts, sp, on_finish=lambda i, o, r: seen.__setitem__(i, (list(o), r)), eos_token_id=eos)
    ex.close()
    assert out == ref
    assert seen == {i: (o, r) for i, (o, r) in enumerate(ref)}


def test_cgopipe_cpu_prompt_logprobs_equal_serial(tiny_dir):
    seqs = _prompts(9, seed=2)
    seqs = [s + [5, 6] for s in seqs]
    ref = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cpu").prompt_logprobs(seqs)
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), Policy(mu=4, n=3, prefill_mu=4, dtype="fp32", weight_quant="fp32"), "cpu")
    out = ex.prompt_logprobs(seqs)
    ex.close()
    assert_scores_match(out, ref)


@pytest.mark.parametrize("mu,n,kv_groups", [(7, 1, 3), (4, 2, 2), (4, 2, 8)])
def test_cgopipe_cpu_grouped_kv_equals_serial(tiny_dir, mu, n, kv_groups):
    """Very ragged prompts: each micro-batch's KV cache is split into length groups (several rows per group),
    attention runs per group over its own length, and the tokens still equal the serial executor's."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 32000, (m,), generator=g).tolist() for m in (40, 3, 90, 5, 41, 7, 60)]
    sp = DecodeSampling(max_new_tokens=10, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cpu").generate(prompts, sp)
    pol = Policy(mu=mu, n=n, prefill_mu=2, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", kv_groups=kv_groups)
    mbs = ex._micro_batches(prompts, sp.max_new_tokens, True, pol.mu)
    assert all(1 < mb.kv.num_groups <= kv_groups for mb in mbs)
    if kv_groups < 8:
        assert any(len(r) > 1 for mb in mbs for r in mb.kv.rows)  # rows really share groups
    plain = sum(2 * 4 * len(mb.rows) * (max(len(prompts[r]) for r in mb.rows) + 10) * 2 * 16 * 4 for mb in mbs)
    assert sum(mb.kv.nbytes for mb in mbs) < plain  # less than one tensor per micro-batch sized for its longest
    out = ex.generate(prompts, sp)
    ex.close()
    assert [o for o, _ in out] == [o for o, _ in ref]


def test_cgopipe_cpu_attention_bytes_and_stage_parts(tiny_dir):
    """The decode report counts the valid K/V bytes CPU attention read (every row, every layer, the new token
    included), splits the CPU attention stage into its parts (waiting for q/k/v, compute, pinning) and times the
    micro-batches' KV cache allocation (outside the phases)."""
    prompts = _prompts(5, seed=3)
    gen = 4
    w = load_checkpoint(tiny_dir, torch.float32)
    spec = w.spec
    ex = CGOPipeExecutor(w, Policy(mu=2, n=3, prefill_mu=2, dtype="fp32", weight_quant="fp32"), "cpu")
    ex.generate(prompts, DecodeSampling(max_new_tokens=gen, stop_at_eos=False))
    ex.close()
    st = ex.stats.extra
    per_pos = 2 * spec.num_kv_heads * spec.head_dim * 4  # K and V, fp32
    # decode step j (0-based) attends prompt + j + 1 positions per row; gen - 1 decode steps
    want = spec.num_layers * per_pos * sum(len(p) + j + 1 for p in prompts for j in range(gen - 1))
    assert st["cpu_attention_valid_kv_bytes"] == want
    parts = st["cpu_attention_wait_qkv"] + st["cpu_attention_compute"] + st["cpu_attention_pin"]
    assert st["cpu_attention_compute"] > 0 and abs(parts - st["cpu_attention"]) < 1e-6 + 1e-3 * st["cpu_attention"]
    assert 0 < st["kv_cache_alloc"] < ex.stats.decode_seconds + ex.stats.prefill_seconds + 60  # the caches' allocation
    from lightning_moe.kernels.cpu_attention import native_available

    if native_available():  # the kernel's own split: one parallel region per (layer, CPU micro-batch, decode step)
        assert st["cpu_attention_native_calls"] == spec.num_layers * 3 * (gen - 1)
        assert 0 < st["cpu_attention_native_region_s"] <= st["cpu_attention_compute"]
        assert 0 < st["cpu_attention_native_busy_thread_s"] <= st["cpu_attention_native_team_thread_s"] * (1 + 1e-9)


def test_cgopipe_cpu_threads(tiny_dir):
    """cpu_threads sets the intra-op thread count (device cpu: no worker thread, CPU attention runs inline); tokens
    are unchanged; bad values are errors."""
    prompts = _prompts(6, seed=4)
    sp = DecodeSampling(max_new_tokens=5, stop_at_eos=False)
    pol = Policy(mu=2, n=3, prefill_mu=2, dtype="fp32", weight_quant="fp32")
    before = torch.get_num_threads()
    try:
        ref = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu")
        want = ref.generate(prompts, sp)
        ref.close()
        ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", cpu_threads=1)
        assert ex.attention.workers is None and torch.get_num_threads() == 1
        assert ex.generate(prompts, sp) == want
        ex.close()
    finally:
        torch.set_num_threads(before)
    for bad in (0, -2, 1.5, "4"):
        with pytest.raises(ValueError, match="cpu_threads"):
            CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", cpu_threads=bad)


def test_cgopipe_prefill_stage_times(tiny_dir):
    """A prefill's stage times are reported apart from the decode's, as prefill_<stage>: its wall time and the KV
    scatter into the CPU caches (kv_write, every chunk and layer); a scoring pass (no KV) has a wall time and no
    KV writes. The timeline has the KV writes' lane."""
    from lightning_moe.pipeline.stage_stats import SPAN_LANES

    w = load_checkpoint(tiny_dir, torch.float32)
    ex = CGOPipeExecutor(w, Policy(mu=2, n=3, prefill_mu=2, dtype="fp32", weight_quant="fp32"), "cpu")
    try:
        ex.timer.start_spans()
        ex.generate(_prompts(5, seed=3), DecodeSampling(max_new_tokens=3, stop_at_eos=False))
        spans = ex.timer.take_spans()
        st = dict(ex.stats.extra)
        assert 0 < st["prefill_kv_write"] < st["prefill_wall"] <= ex.stats.prefill_seconds + 1e-6
        assert "decode_wall" in st and "kv_write" not in st  # decode's own stages keep their names
        kv = [s for s in spans if s["stage"] == "kv_write"]
        assert kv and all(s["phase"] == "prefill" and s["lane"] == SPAN_LANES["kv_write"] for s in kv)
        assert len(kv) == w.spec.num_layers * 3  # 3 prefill chunks (5 rows, 2 per chunk) x layers
        ex.prompt_logprobs(_prompts(3, seed=4))
        assert ex.stats.extra["prefill_wall"] > st["prefill_wall"]
        assert ex.stats.extra["prefill_kv_write"] == st["prefill_kv_write"]  # scoring writes no KV
    finally:
        ex.close()


@pytest.mark.parametrize("mu,n", [(5, 1), (3, 4)])
def test_cgopipe_page_issue_visit_start(tiny_dir, mu, n):
    """page_issue="visit_start": every page of a decode visit's successor is issued as the visit starts (before its
    first micro-batch's attention), the default slot by slot after each micro-batch's attention; the same pages
    cross (h2d bytes) and the tokens are the default schedule's."""
    prompts = _prompts(11, seed=3)
    sp = DecodeSampling(max_new_tokens=6, stop_at_eos=False)
    pol = Policy(mu=mu, n=n, prefill_mu=2, resident_experts=2, dtype="fp32", weight_quant="fp32")
    runs = {}
    for issue in ("after_attention", "visit_start"):
        # without the look-ahead, layer l's attentions are submitted inside visit l (what the order below reads)
        ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", page_issue=issue,
                             layer_lookahead=False)
        events = []
        issue_slot, submit = ex.weight_stream.prefetch_slot, ex.attention.submit_cpu

        def slot(visit, k, slots, _f=issue_slot, _e=events):
            _e.append(("pages", visit, k, slots))
            return _f(visit, k, slots)

        def attend(l, mb, *a, _f=submit, _e=events, _ex=ex):
            _e.append(("attention", _ex.weight_stream.visit))
            return _f(l, mb, *a)

        ex.weight_stream.prefetch_slot, ex.attention.submit_cpu = slot, attend
        out = ex.generate(prompts, sp)
        ex.close()
        runs[issue] = ([o for o, _ in out], ex.stats.h2d_bytes, events)
    (ref, ref_bytes, ev0), (got, got_bytes, ev1) = runs["after_attention"], runs["visit_start"]
    assert got == ref and got_bytes == ref_bytes

    def order(events):  # per decode visit v: is the first issue of v + 1's pages before v's first attention?
        first_attn, first_pages = {}, {}
        for i, e in enumerate(events):
            if e[0] == "attention":
                first_attn.setdefault(e[1], i)
            else:
                first_pages.setdefault(e[1] - 1, (i, e[2:]))
        return {v: (first_pages[v][0] < i, first_pages[v][1]) for v, i in first_attn.items() if v in first_pages}

    early, late = order(ev1), order(ev0)
    assert len(early) == len(late) > 6
    assert all(before and slots == (0, 1) for before, slots in early.values())  # all pages, before the attention
    assert not any(before for before, _ in late.values())  # the default: slot by slot, after it


@pytest.mark.parametrize("mu,n,gpu_path", [(5, 1, 0), (3, 4, 0), (3, 4, 1)])
def test_cgopipe_layer_lookahead_submits_each_next_layer_attention_right_after_its_post_attention(tiny_dir, mu, n,
                                                                                                     gpu_path):
    """layer_lookahead (the default): micro-batch k's CPU attention of layer l >= 1 is submitted right after its
    layer l-1 post-attention was issued (inside layer l-1's loop), so the worker never waits at a layer boundary;
    without it, layer l's are submitted in layer l's loop. The tokens, the pages crossed and the KV read are the
    schedule without it, with refills (11 prompts, ragged lengths), every micro-batch on the CPU or (``gpu_path``)
    the first on the GPU-attention path (forced on device cpu, as benchmarks/host_ops.py does: its cache stays on the
    CPU), which the look-ahead leaves to each layer's loop."""
    prompts = _prompts(11, seed=5)
    sp = DecodeSampling(max_new_tokens=7, stop_at_eos=False)
    pol = Policy(mu=mu, n=n, prefill_mu=2, resident_experts=2, n_gpu_attn=gpu_path, dtype="fp32", weight_quant="fp32")
    runs = {}
    for ahead in (False, True):
        ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", layer_lookahead=ahead)
        orig = ex._micro_batches

        def forced(*a, _orig=orig, **k):  # device cpu never puts attention on the GPU path: force the first
            mbs = _orig(*a, **k)
            for i, mb in enumerate(mbs):
                mb.on_gpu = i < gpu_path
            return mbs

        ex._micro_batches = forced
        events, layers = [], ex.spec.num_layers
        gpu, gpu_calls = ex.attention.gpu, []
        ex.attention.gpu = lambda l, mb, *a, _f=gpu, _c=gpu_calls: (_c.append(l), _f(l, mb, *a))[1]
        submit, finish = ex.attention.submit_cpu, ex._finish_micro_batch

        def attend(l, mb, *a, _f=submit, _e=events):
            _e.append(("submit", l, id(mb)))
            return _f(l, mb, *a)

        def done(l, visit, slots, k, mb, *a, _f=finish, _e=events):
            _e.append(("finish", l, id(mb)))
            return _f(l, visit, slots, k, mb, *a)

        ex.attention.submit_cpu, ex._finish_micro_batch = attend, done
        out = ex.generate(prompts, sp)
        ex.close()
        runs[ahead] = ([o for o, _ in out], ex.stats.h2d_bytes, ex.stats.extra.get("cpu_attention_valid_kv_bytes"), events)
        assert (len(gpu_calls) > layers) == bool(gpu_path)  # the forced micro-batch took the GPU path every layer
    (ref, ref_h2d, ref_kv, ev0), (got, got_h2d, got_kv, ev1) = runs[False], runs[True]
    assert got == ref and got_h2d == ref_h2d and got_kv == ref_kv

    def after_own_finish(events):  # per submit of a layer >= 1: was the event before it this micro-batch's finish?
        return [events[i - 1] == ("finish", l - 1, m) for i, (e, l, m) in enumerate(events) if e == "submit" and l >= 1]

    early, late = after_own_finish(ev1), after_own_finish(ev0)
    assert len(early) == len(late) > 2 * layers
    assert all(early)
    # without it, with several micro-batches: layer l's loop submits micro-batch k after finishing k-1 of layer l
    #   (one micro-batch: the same order either way)
    assert all(late) == (n == 1)


def test_bench_cgopipe_pages_variant():
    """bench_cgopipe's ``pages`` variant key: CGOPipe's page_issue, checked by name."""
    from benchmarks.bench_cgopipe import parse_variants

    assert parse_variants("pages=visit_start,h2d=kernel;default") == ({"pages": "visit_start", "h2d": "kernel"}, {})
    with pytest.raises(ValueError, match="pages must be after_attention or visit_start"):
        parse_variants("pages=early")
    assert parse_variants("ahead=off;default") == ({"ahead": "off"}, {})
    with pytest.raises(ValueError, match="ahead must be on or off"):
        parse_variants("ahead=yes")
