"""Continuous refill (issue 43.2): a generate call with more prompts than slots decodes N at once and gives each freed
slot (EOS, a stop id, a stop string, max_new_tokens) to the next waiting request, prefilled between decode steps.

References: greedy fp32 records of the same prompts without refill (the serial executor over all prompts at once, and
each executor called per batch of at most N prompts): token ids and finish reasons exactly, log-probs to 1e-4 (fp32),
callbacks with the caller's row indices. Occupancy (decode tokens / (decode steps x slots)) of a ragged job through
``run_job`` >= 0.9 with refill.
"""

import json

import pytest
import torch

from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.refill import SlotTable
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor
from lightning_moe.policy.policy import Policy

LP_TOL = 1e-4  # fp32 log-probs: the same math over differently shaped batches


def _prompts(n, seed, lo=1, hi=30, vocab=32000):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def _cgopipe(tiny_dir, mu, n, **opts):
    pol = Policy(mu=mu, n=n, prefill_mu=2, dtype="fp32", weight_quant="fp32")
    return CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", **opts)


def _serial(tiny_dir, slots=None):
    return SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cpu", slots=slots)


class Log:
    """Everything an executor reports through the callbacks, keyed by the caller's row index."""

    def __init__(self, stop_tok=None):
        self.finish, self.tokens, self.lps, self.stop_tok = {}, {}, {}, stop_tok

    def on_finish(self, r, out, reason):
        assert r not in self.finish  # once per request
        self.finish[r] = (list(out), reason)

    def on_tokens(self, rows, toks):
        for r, t in zip(rows, toks):
            self.tokens.setdefault(r, []).append(t)

    def on_logprobs(self, rows, entries):
        for r, e in zip(rows, entries):
            self.lps.setdefault(r, []).append(e)

    def stop_rows(self, outs):  # a "stop string": the output holds stop_tok right after another token
        return {r for r, o in outs.items() if self.stop_tok is not None and self.stop_tok in o[1:]}

    def kw(self):
        return dict(on_finish=self.on_finish, on_tokens=self.on_tokens, on_logprobs=self.on_logprobs,
                    stop_rows=self.stop_rows)


def _run(ex, prompts, sp, per_call, stop_tok, prefixes=None, **kw):
    """Generate ``prompts`` in calls of ``per_call`` prompts; results and the callbacks' log, rows in prompt order."""
    log, out = Log(stop_tok), []
    for i in range(0, len(prompts), per_call):
        part = Log(stop_tok)
        pre = prefixes[i: i + per_call] if prefixes is not None else None
        out += ex.generate(prompts[i: i + per_call], sp, prefixes=pre, **part.kw(), **kw)
        for name in ("finish", "tokens", "lps"):
            getattr(log, name).update({r + i: v for r, v in getattr(part, name).items()})
    return out, log


def _same(a, b):
    """Equal records and callbacks (ids, reasons, tokens: exactly; log-probs: LP_TOL)."""
    (out_a, log_a), (out_b, log_b) = a, b
    assert out_a == out_b
    assert log_a.finish == log_b.finish == {i: (o, r) for i, (o, r) in enumerate(out_a)}
    assert log_a.tokens == log_b.tokens
    assert log_a.lps.keys() == log_b.lps.keys()
    for r in log_a.lps:
        for (ca, ta), (cb, tb) in zip(log_a.lps[r], log_b.lps[r], strict=True):
            assert abs(ca - cb) <= LP_TOL
            assert [i for i, _ in ta] == [i for i, _ in tb]
            assert max(abs(x - y) for (_, x), (_, y) in zip(ta, tb)) <= LP_TOL


def _stops(free, seed):
    """From unstopped outputs: an EOS id, a stop id and a stop-string token, each from a different request's early
    output (position 1..3), so the three kinds all finish some request before max_new_tokens."""
    g = torch.Generator().manual_seed(seed)
    picks = []
    for o, _ in free:
        t = o[int(torch.randint(1, 4, (1,), generator=g))]
        if t not in picks:
            picks.append(t)
        if len(picks) == 3:
            return picks
    raise AssertionError("too few distinct tokens")


@pytest.mark.parametrize("executor", ["serial", "cgopipe"])
def test_refill_records_equal_no_refill(tiny_dir, executor):
    """17 ragged prompts, N = 4 slots (cgopipe: 2 micro-batches of 2): EOS, a stop id, a stop string (stop_rows), a
    prefix (resume) on some prompts and log-probs; records, on_finish, on_tokens and on_logprobs equal the runs
    without refill (serial over all prompts at once; the executor per batch of <= N prompts)."""
    seed = int(torch.randint(0, 10_000, (1,)))
    prompts = _prompts(17, seed)
    G = 12
    ref_ex = _serial(tiny_dir)
    free = ref_ex.generate(prompts, DecodeSampling(max_new_tokens=G, stop_at_eos=False))
    eos, stop_id, stop_tok = _stops(free, seed)
    prefixes = [free[i][0][:3] if i % 5 == 2 else [] for i in range(len(prompts))]  # resumed after 3 tokens
    sp = DecodeSampling(max_new_tokens=G, stop_at_eos=True, stop_token_ids=(stop_id,), logprobs=2)
    kw = dict(eos_token_id=eos)
    ref = _run(ref_ex, prompts, sp, len(prompts), stop_tok, prefixes, **kw)
    reasons = [r for _, r in ref[0]]
    assert "stop" in reasons and "length" in reasons  # ragged: some stop early, some run to G
    ex = _serial(tiny_dir, slots=4) if executor == "serial" else _cgopipe(tiny_dir, 2, 2, refill_min_free=1)
    batched = _run(ex, prompts, sp, 4, stop_tok, prefixes, **kw)  # no refill: <= N prompts per call
    steps_batched = ex.stats.decode_steps
    ex.stats.decode_steps = 0
    refilled = _run(ex, prompts, sp, len(prompts), stop_tok, prefixes, **kw)
    if executor == "cgopipe":
        ex.close()
    _same(refilled, ref)
    _same(batched, ref)
    assert ex.stats.decode_steps < steps_batched  # refill: fewer decode steps for the same tokens


def test_free_slots_attend_nothing(tiny_dir, monkeypatch):
    """A ragged call through cgopipe (13 prompts, N = 4 slots in 2 micro-batches, stop ids from the unstopped
    outputs): before every decode step each free slot's KV length is 0, so its throwaway token attends one position,
    as the refill schedule prices a free slot (``schedule_seconds``: a free slot attends ~nothing). Before the fix a
    freed slot's length grew by one a step through the drain (the GPU host's ragged job: CPU attention 2.5x its HRM
    price). Steps with free slots must occur; records equal the serial executor's without refill."""
    seed = int(torch.randint(0, 10_000, (1,)))
    prompts = _prompts(13, seed)
    G = 10
    ref_ex = _serial(tiny_dir)
    free = ref_ex.generate(prompts, DecodeSampling(max_new_tokens=G, stop_at_eos=False))
    sp = DecodeSampling(max_new_tokens=G, stop_at_eos=False, stop_token_ids=tuple(_stops(free, seed)))
    ref = _run(ref_ex, prompts, sp, len(prompts), None)
    tables, seen = [], {"free": 0}
    place = SlotTable.place
    monkeypatch.setattr(SlotTable, "place", lambda self, mb_slots: (tables.append(self), place(self, mb_slots))[1])
    step = CGOPipeExecutor._decode_step

    def checked(self, mbs, tokens):
        for mb in mbs:
            free_rows = torch.tensor(tables[-1].requests(mb.rows)) < 0
            seen["free"] += int(free_rows.sum())
            assert (mb.kv.lengths[free_rows] == 0).all(), mb.kv.lengths[free_rows].tolist()
        return step(self, mbs, tokens)

    monkeypatch.setattr(CGOPipeExecutor, "_decode_step", checked)
    ex = _cgopipe(tiny_dir, 2, 2, refill_min_free=2)
    got = _run(ex, prompts, sp, len(prompts), None)
    ex.close()
    _same(got, ref)
    assert seen["free"] > 0  # some step ran with free slots (the refill threshold, the drain)


@pytest.mark.parametrize("kind", ["eos", "stop_id", "stop_string", "length"])
@pytest.mark.parametrize("executor", ["serial", "cgopipe"])
def test_each_stop_kind_frees_its_slot(tiny_dir, executor, kind):
    """One slot, three requests: request 0 finishes by ``kind`` early; the slot goes to request 1 at once, so the
    decode steps are exactly sum(len(output) - 1) (each request's first token comes from its prefill) and the records
    equal the serial executor's without refill."""
    prompts = _prompts(3, int(torch.randint(0, 10_000, (1,))))
    G = 8
    ref_ex = _serial(tiny_dir)
    free = ref_ex.generate(prompts, DecodeSampling(max_new_tokens=G, stop_at_eos=False))
    o0 = free[0][0]
    j = next(j for j in range(2, G) if o0[j] not in o0[:j])  # request 0 stops at its (j+1)-th token
    t = o0[j]  # the stop of this kind (requests 1-2 may stop on it as well: a freed slot all the same)
    sp = DecodeSampling(max_new_tokens=G, stop_at_eos=kind == "eos", stop_token_ids=(t,) if kind == "stop_id" else ())
    stop_tok = t if kind == "stop_string" else None
    kw = dict(eos_token_id=t if kind == "eos" else 0)
    ref = _run(ref_ex, prompts, sp, 3, stop_tok, **kw)
    assert len(ref[0][0][0]) == (j + 1 if kind != "length" else G) and ref[0][0][1] == ("stop" if kind != "length" else "length")
    ex = _serial(tiny_dir, slots=1) if executor == "serial" else _cgopipe(tiny_dir, 1, 1)
    got = _run(ex, prompts, sp, 3, stop_tok, **kw)
    if executor == "cgopipe":
        ex.close()
    _same(got, ref)
    assert ex.stats.decode_steps == sum(len(o) - 1 for o, _ in ref[0]) == ex.stats.slot_steps
    assert ex.stats.slot_occupancy == 1.0


def test_slot_table_best_fit_and_due():
    """Capacities are the N largest needs; a request takes the smallest free slot that fits it, in the caller's
    order, skipping one that fits none; refills wait for min_free free slots unless nothing decodes or every waiting
    request fits the free count."""
    t = SlotTable([5, 9, 3, 12, 7], slots=3, min_free=2)
    assert t.caps == [7, 9, 12]
    assert t.due() and t.assign() == [(0, 0), (1, 1), (2, 2)]  # need 5 -> cap 7, 9 -> 9, 3 -> 12
    assert t.waiting == [3, 4] and t.live == 3 and not t.due()
    assert t.release([0]) == [0] and not t.due()  # one free (< min_free), two waiting
    assert t.release([2]) == [2] and t.due()
    assert t.assign() == [(2, 3), (0, 4)]  # need 12 fits only slot 2 (cap 12); need 7 -> cap 7
    t2 = SlotTable([4, 10, 4], slots=2, min_free=1)  # caps [4, 10]
    t2.assign()
    assert t2.req == [0, 1] and t2.waiting == [2]
    assert t2.release([1]) == [1] and t2.due()  # slot 1 (cap 10) frees: request 2 (need 4) fits it
    assert t2.assign() == [(1, 2)]
    t3 = SlotTable([4, 10, 10], slots=2, min_free=1)  # caps [10, 10]: nothing waits once both are taken
    t3.assign()
    t3.release([0])
    assert t3.due() and t3.assign() == [(0, 2)]
    t4 = SlotTable([3, 9, 4, 9], slots=2, min_free=1)  # caps [9, 9]
    assert t4.assign() == [(0, 0), (1, 1)] and t4.release([1]) == [1]
    assert t4.assign() == [(1, 2)]  # request 2 (need 4) before request 3, caller order


def _job_file(tmp_path, prompts):
    data = tmp_path / "in.jsonl"
    with open(data, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"r{i}", "prompt_token_ids": p}) + "\n")
    return data


def test_ragged_job_occupancy(tmp_path, tiny_dir):
    """A ragged CPU job through run_job (cgopipe, N = 2 slots, 40 requests = 20 N): stop ids chosen from the unstopped
    outputs so the mean output is <= max_new_tokens / 4; with refill the report's slot occupancy is >= 0.9 (measured
    without refill on a job of this kind: 0.38), and the records equal the unstopped serial outputs cut at their first
    stop id (greedy: a stop changes nothing before it)."""
    from lightning_moe.app.engine import run_job
    from lightning_moe.config import job_from_dict
    from lightning_moe.data.writer import read_results

    G, B = 24, 40
    prompts = _prompts(B, 11, lo=2, hi=20)
    free = [o for o, _ in _serial(tiny_dir).generate(prompts, DecodeSampling(max_new_tokens=G, stop_at_eos=False))]

    def cut(o, stop):
        return next((o[: j + 1] for j, t in enumerate(o) if t in stop), o)

    stop = set()  # one request's token at a time (position 0..5) until the mean stopped length is <= G / 4
    for o in free:
        if sum(len(cut(oo, stop)) for oo in free) <= B * G / 4:
            break
        stop.add(o[len(stop) % 6])
    want = {f"r{i}": (cut(o, stop), "stop" if len(cut(o, stop)) < G or o[-1] in stop else "length")
            for i, o in enumerate(free)}
    assert sum(len(o) for o, _ in want.values()) <= B * G / 4 and {r for _, r in want.values()} == {"stop", "length"}
    d = {"model": str(tiny_dir), "data": {"source": "jsonl", "path": str(_job_file(tmp_path, prompts))},
         "output": {"path": str(tmp_path / "cg.jsonl")}, "device": "cpu", "dtype": "float32", "executor": "cgopipe",
         "policy": {"mu": 1, "n": 2}, "expert_ffn": "torch",
         "generation": {"max_new_tokens": G, "temperature": 0.0, "stop_at_eos": False, "stop_token_ids": sorted(stop)}}
    job = job_from_dict(d, "test.yaml", base_dir=str(tmp_path))
    run_job(job, progress=False)
    got = {r["id"]: (r["output_ids"], r["finish_reason"]) for r in read_results(job.output.path)}
    assert got == want
    rep = json.load(open(job.output.report_path))
    assert rep["slot_occupancy"] >= 0.9, rep["slot_occupancy"]
    # the report's refill block: the schedule replayed over the records' lengths is what the executor ran (exact
    # counts); on the CPU no GPU-host price (predicted_from_lengths) is given
    ref = rep["refill"]
    sim, ran = ref["schedule_from_lengths"], ref["measured"]
    assert (sim["decode_steps"], sim["prefill_passes"]) == (ran["decode_steps"], ran["prefill_passes"]) == (
        rep["stats"]["decode_steps"], rep["stats"]["prefill_passes"])
    assert sim["slot_occupancy"] == pytest.approx(rep["slot_occupancy"], rel=1e-12)
    assert sim["generated_tokens"] == sum(len(o) for o, _ in want.values()) == rep["generated_tokens"]
    assert ref["slots"] == 2 and ref["min_free"] == 1 and "predicted_from_lengths" not in ref
    assert 0 < sim["drain_steps"] < G
