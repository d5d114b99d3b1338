"""The sampling seam both executors share (pipeline.sampling.DecodeRows), the executor contract's signatures
(pipeline.executor.Executor) and CGOPipe's options (pipeline.cgopipe_options.CGOPipeOptions, checked once).

DecodeRows is compared with a plain per-step reference (the serial executor's loop before the seam existed) on random
logits, random micro-batch splits, EOS, stop token ids, max_new_tokens, stop strings and prefixes: the same tokens,
results and callbacks (on_finish / on_tokens in the same order; on_logprobs entries within 1e-6)."""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.cgopipe_options import CGOPipeOptions
from lightning_moe.pipeline.executor import Executor, RunStats
from lightning_moe.pipeline.sampling import DecodeRows, DecodeSampling, finish_reason, sample, token_logprobs
from lightning_moe.pipeline.serial import SerialExecutor


def _reference(pre, params, eos, seeds, steps_logits, stop_pair):
    """The plain loop: per step, sample the alive rows, log-probs, append, finish by rule, then stop strings."""
    outputs, results, events = [list(p) for p in pre], [None] * len(pre), []
    alive = list(range(len(pre)))
    for logits in steps_logits:
        if not alive:
            break
        lg = logits[alive]
        sd = [seeds[r] for r in alive] if seeds is not None and not params.greedy else None
        toks = sample(lg, params, sd, [len(outputs[r]) for r in alive] if sd else None)
        if params.logprobs is not None:
            events.append(("lp", list(alive), token_logprobs(lg, toks, params.logprobs)))
        still = []
        for r, t in zip(alive, toks.tolist()):
            outputs[r].append(t)
            reason = finish_reason(params, eos, t, len(outputs[r]))
            if reason is None:
                still.append(r)
            else:
                results[r] = (outputs[r], reason)
                events.append(("fin", r, list(outputs[r]), reason))
        for r in [r for r in still if _has_pair(outputs[r], stop_pair)]:
            results[r] = (outputs[r], "stop")
            events.append(("fin", r, list(outputs[r]), "stop"))
        events.append(("tok", list(alive), toks.tolist()))
        alive = [r for r in still if results[r] is None]
    return results, events


def _has_pair(out, stop):
    """The stand-in for a stop string: the output's last token is in ``stop``."""
    return bool(out) and out[-1] in stop


def _seam(pre, params, eos, seeds, steps_logits, stop_pair, splits):
    """The same through DecodeRows, each step's rows committed in ``splits`` micro-batches (finished rows keep
    their slot, as in CGOPipe)."""
    events, stats = [], RunStats()
    rows = DecodeRows([list(p) for p in pre], params, eos, seeds, stats,
                      on_finish=lambda r, out, why: events.append(("fin", r, list(out), why)),
                      on_tokens=lambda rs, ts: events.append(("tok", list(rs), list(ts))),
                      stop_rows=lambda live: {r for r, out in live.items() if _has_pair(out, stop_pair)},
                      on_logprobs=lambda rs, ent: events.append(("lp", list(rs), ent)))
    for logits in steps_logits:
        if not rows.running:
            break
        for mb in splits:
            rows.commit(mb, logits[mb])
        rows.end_step()
    lp = [e for e in events if e[0] == "lp"]  # one entry list per micro-batch: merge a step's into one
    return rows.results, [e for e in events if e[0] != "lp"], lp, stats


@pytest.mark.parametrize("seed", range(12))
def test_decode_rows_equal_reference(seed):
    rng = random.Random(seed)
    B, V = rng.randint(1, 9), rng.choice([5, 17, 33])
    pre = [[rng.randrange(V) for _ in range(rng.randint(0, 2))] for _ in range(B)]
    params = DecodeSampling(max_new_tokens=rng.randint(3, 9), temperature=rng.choice([0.0, 0.8]),
                            top_p=rng.choice([1.0, 0.9]), stop_at_eos=rng.random() < 0.7,
                            stop_token_ids=tuple(rng.sample(range(V), rng.randint(0, 2))),
                            logprobs=rng.choice([None, 0, 3]))
    eos, seeds = rng.randrange(V), [rng.randrange(1 << 30) for _ in range(B)]
    g = torch.Generator().manual_seed(seed)
    steps = [torch.randn(B, V, generator=g) * 3 for _ in range(params.max_new_tokens)]
    stop_pair = set(rng.sample(range(V), max(1, V // 4)))
    order = list(range(B))
    cut = sorted(rng.sample(range(1, B), rng.randint(0, B - 1))) if B > 1 else []
    splits = [order[a:b] for a, b in zip([0] + cut, cut + [B])]
    want, want_ev = _reference(pre, params, eos, seeds, steps, stop_pair)
    got, got_ev, got_lp, stats = _seam(pre, params, eos, seeds, steps, stop_pair, splits)
    assert got == want
    assert got_ev == [e for e in want_ev if e[0] != "lp"]
    assert stats.generated_tokens == sum(len(o) - len(p) for (o, _), p in zip(want, pre))
    want_lp = {}  # (row, index among its generated tokens) -> entry
    for _, rs, ent in (e for e in want_ev if e[0] == "lp"):
        for r, e in zip(rs, ent):
            want_lp[(r, sum(1 for k in want_lp if k[0] == r))] = e
    seen = {}
    for _, rs, ent in got_lp:
        for r, e in zip(rs, ent):
            key = (r, seen.get(r, 0))
            seen[r] = key[1] + 1
            (c, top), (c2, top2) = e, want_lp[key]
            assert abs(c - c2) < 1e-6
            assert (top is None) == (top2 is None)
            if top is not None:
                assert [i for i, _ in top] == [i for i, _ in top2]
                assert max(abs(a - b) for (_, a), (_, b) in zip(top, top2)) < 1e-6
    assert len(seen) == len({r for r, _ in want_lp}) and sum(seen.values()) == len(want_lp)


def test_executors_keep_the_contract_signature():
    """generate and prompt_logprobs take exactly the protocol's parameters, with its defaults, in both executors."""
    for name in ("generate", "prompt_logprobs"):
        want = inspect.signature(getattr(Executor, name)).parameters
        for cls in (SerialExecutor, CGOPipeExecutor):
            got = inspect.signature(getattr(cls, name)).parameters
            assert list(got) == list(want), (cls.__name__, name)
            assert [p.default for p in got.values()] == [p.default for p in want.values()], (cls.__name__, name)


@pytest.mark.parametrize("field,value,msg", [
    ("ffn", "cuda", "ffn must be torch, auto, triton, grouped_mm or mm_loop"),
    ("kv_groups", 0, "kv_groups must be an int >= 1"),
    ("cpu_threads", 0, "cpu_threads must be None or an int >= 1"),
    ("attention_h2d", "zero", "attention_h2d must be auto, kernel or dma"),
    ("gpu_attention", "cuda", "gpu_attention must be torch or triton"),
    ("page_issue", "early", "page_issue must be after_attention or visit_start"),
    ("layer_lookahead", 1, "layer_lookahead must be a bool"),
    ("score_chunk_tokens", True, "score_chunk_tokens must be an int >= 1"),
])
def test_options_checked_once_by_name(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        CGOPipeOptions(**{field: value})
    with pytest.raises(ValueError, match=r"unknown option 'ffn_kind'"):
        CGOPipeOptions.from_kwargs({"ffn_kind": "torch"})
    opts = CGOPipeOptions.from_kwargs({"ffn": "mm_loop", "kv_groups": 3})
    assert (opts.ffn, opts.kv_groups, opts.ffn_kind(cuda=False)) == ("mm_loop", 3, "mm_loop")
    assert CGOPipeOptions(ffn="triton").ffn_kind(cuda=False) == "torch"  # Triton needs CUDA: the torch loop
    with pytest.raises(AttributeError):
        opts.ffn = "torch"  # frozen


@pytest.mark.parametrize("kind", ["serial", "cgopipe"])
def test_generate_prologue_eos_default_and_empty_batch(tiny_dir, kind):
    """Executor.generate (one body for both executors): no prompts -> [] without running anything; eos_token_id
    defaults to the spec's (the run stops at its first occurrence) and an explicit one overrides it."""
    import dataclasses

    from lightning_moe.model.weights import load_checkpoint
    from lightning_moe.policy.policy import Policy

    w = load_checkpoint(tiny_dir, torch.float32)
    if kind == "serial":
        ex = SerialExecutor(w, "cpu")
    else:
        ex = CGOPipeExecutor(w, Policy(mu=2, n=1, prefill_mu=2, dtype="fp32", weight_quant="fp32"), "cpu")
    params = DecodeSampling(max_new_tokens=6)
    assert ex.generate([], params) == [] and ex.stats.decode_steps == 0 and ex.stats.prefill_tokens == 0
    prompts = [[5, 17, 300, 42], [9, 8]]
    free = ex.generate(prompts, params, eos_token_id=-1)  # an EOS no token equals: both rows run to the length
    assert [r for _, r in free] == ["length", "length"]
    t = free[0][0][2]  # row 0's third token as the spec's EOS
    ex.spec = dataclasses.replace(ex.spec, eos_token_id=t)
    got = ex.generate(prompts, params)
    cut = free[0][0].index(t) + 1
    assert got[0] == (free[0][0][:cut], "stop")
    assert ex.generate(prompts, params, eos_token_id=-1) == free  # the argument wins over the spec's
