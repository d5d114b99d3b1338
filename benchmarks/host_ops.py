"""Host cost of CGOPipe's decode layer, per (decode layer, micro-batch): ATen ops, host microseconds, host syncs.

Runs :class:`~lightning_moe.pipeline.cgopipe.CGOPipeExecutor` decode on the host-issue probe's tiny model
(``profiler._host_probe_spec``: the generic one, Mixtral-shaped, D = 256, 8 experts, 2 resident per layer; ``--probe
KEY``: another key of ``profiler.host_probe_keys``, e.g. ``mla`` (DeepSeek-V2-shaped), ``qwen3_moe``, ``mixtral/int4``,
``gpt_oss/mxfp4``: the family's model, its experts in the key's format; ``--mla`` is ``--probe mla``) on the CPU in
fp32, 2 micro-batches of ``--mu`` prompts of spread lengths (8 KV length groups each), as ``profiler.measure_host_issue`` does, once with both micro-batches attending on the CPU (n_gpu_attn 0) and
once with both on the "GPU" path (n_gpu_attn 2). On ``device: cpu`` the executor never puts a micro-batch's attention
on the GPU (``micro_batches``: ``on_gpu = cuda and k < n_gpu_attn``), so this script sets ``MicroBatch.on_gpu`` for the
first ``n_gpu_attn`` micro-batches itself: their KV caches stay on the CPU device and ``AttentionPlacement.gpu`` runs
its GPU code (append, then the family's torch ``decode_attention`` per length group) on it.

Reports, per (decode layer, micro-batch), for each placement:

* ``ops``: ATen ops dispatched inside ``_decode_layer`` (a ``TorchDispatchMode``), split by region (pre-attention,
  attention, finish = receive + page slot, post-attention, expert FFN, visit bookkeeping), in one decode step
  (``--count-step``: the first by default, which also pays what is made once per step or per cache; a later step
  shows the steady state);
* ``host_us``: host wall microseconds of ``_decode_layer`` (no dispatch mode), and the profile's own number
  (decode seconds / (steps x layers x micro-batches), ``measure_host_issue``'s definition: embedding, logits and
  sampling included);
* ``syncs``: calls that would stall the host on CUDA: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``,
  ``bool(t)``), ``nonzero``, boolean-mask indexing, ``equal``, ``.tolist()`` / ``.cpu()`` / ``.numpy()``,
  ``torch.cuda.synchronize`` / ``Event.synchronize`` / ``Stream.synchronize``, counted only where the tensor read
  would live on the device (a provenance tag: seeded with the executor's device weights, hidden states, positions,
  page buffers and GPU-attention caches, carried to every op output that has a tagged input; the CPU-attention worker's
  region counts as host); ``--sites`` lists each sync's call site, host reads too;
* with ``--profile``, a cProfile table (own time) of ``_decode_layer``.

These are CPU proxies of the CUDA host thread: on CUDA an op costs its dispatch plus a launch (~5-10 us), so the op
count is the number to watch; CPU wall includes the tiny model's CPU math.

    python benchmarks/host_ops.py                     # both placements, torch expert loop (the CPU default)
    python benchmarks/host_ops.py --ffn grouped_mm    # the sync-free grouped expert path CUDA runs (Triton there)
    python benchmarks/host_ops.py --sites --profile
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import sys
import time
import weakref
from collections import Counter
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "equal", "is_nonzero",
            "allclose", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave"}
PY_SYNCS = ("tolist", "cpu", "numpy")  # torch.Tensor methods that read a device tensor on the host (no ATen dispatch
#   on a CPU tensor, so they are patched)


class Provenance:
    """Tensors that would live on the device on CUDA (by identity, weakly held)."""

    def __init__(self):
        self._ids: dict[int, Any] = {}

    def add(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self._ids[id(t)] = weakref.ref(t)

    def add_all(self, obj, depth: int = 4) -> None:
        """Every tensor reachable from ``obj`` (containers, dataclasses, plain objects) up to ``depth`` levels."""
        if isinstance(obj, torch.Tensor):
            self.add(obj)
        elif depth <= 0 or obj is None or isinstance(obj, (str, int, float, bool)):
            return
        elif isinstance(obj, dict):
            for v in obj.values():
                self.add_all(v, depth - 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                self.add_all(v, depth - 1)
        elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                self.add_all(v, depth - 1)

    def has(self, t) -> bool:
        r = self._ids.get(id(t)) if isinstance(t, torch.Tensor) else None
        return r is not None and r() is t


def _tensors(args) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_tensors(a))
    return out


def _site() -> str:
    """file:line of the innermost lightning_moe frame of the caller."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if "lightning_moe" in fn and "benchmarks" not in fn:
            return f"{fn.split('lightning_moe/')[-1]}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "?"


class Recorder(TorchDispatchMode):
    """Counts ATen ops per region and the would-be host syncs (see the module docstring)."""

    def __init__(self, prov: Provenance):
        super().__init__()
        self.prov = prov
        self.regions: list[str] = ["other"]
        self.host_region = 0  # > 0 inside the CPU-attention worker's code (its tensors are host tensors on CUDA)
        self.ops: Counter = Counter()  # (region, op) -> count
        self.syncs: Counter = Counter()  # (kind, site, on_device) -> count
        self.active = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.active:
            return out
        name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
        self.ops[(self.regions[-1], name)] += 1
        ins = _tensors(list(args) + list(kwargs.values()))
        dev = self.host_region == 0 and any(self.prov.has(t) for t in ins)
        boolean_index = name in ("index", "index_put", "index_put_") and any(
            t.dtype == torch.bool for t in _tensors(args[1:2]))
        if name in SYNC_OPS or boolean_index:
            self.syncs[(name + ("[bool mask]" if boolean_index else ""), _site(), dev)] += 1
        if dev:
            for t in _tensors([out]):
                self.prov.add(t)
        return out

    def py_sync(self, kind: str, t) -> None:
        if self.active:
            self.syncs[(kind, _site(), self.host_region == 0 and self.prov.has(t))] += 1


def _patch_py_syncs(rec: Recorder) -> list:
    """Patch torch.Tensor.tolist/cpu/numpy and the CUDA synchronize calls to report to ``rec``; returns undo pairs."""
    undo = []
    for name in PY_SYNCS:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, __orig=orig, __name=name, **k):
            rec.py_sync("." + __name + "()", self)
            return __orig(self, *a, **k)

        undo.append((torch.Tensor, name, orig))
        setattr(torch.Tensor, name, wrapped)
    for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                        (torch.cuda.Stream, "synchronize")):
        orig = getattr(owner, name)

        def wrapped(*a, __orig=orig, __name=f"{getattr(owner, '__name__', owner)}.{name}", **k):
            rec.py_sync(__name, None)
            if rec.active:
                rec.syncs[(__name, _site(), True)] += 1
            return __orig(*a, **k)

        undo.append((owner, name, orig))
        setattr(owner, name, wrapped)
    return undo


def _region(rec: Recorder, name: str, fn, host: bool = False):
    """``fn`` wrapped so that the ops it dispatches count as region ``name`` (``host``: the worker's host region)."""
    def wrapped(*a, **k):
        rec.regions.append(name)
        rec.host_region += host
        try:
            return fn(*a, **k)
        finally:
            rec.regions.pop()
            rec.host_region -= host
    return wrapped


def build(args, n_gpu: int):
    """The executor, the prompts and the sampling of one placement (``measure_host_issue``'s setup)."""
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.pipeline.profiler import _host_probe_spec, _host_probe_weights
    from lightning_moe.policy.policy import Policy

    spec = _host_probe_spec(args.layers, args.probe)
    g = torch.Generator().manual_seed(0)
    lens = torch.linspace(8, 200, 2 * args.mu).round().long().tolist()  # 8 KV length groups per micro-batch
    prompts = [torch.randint(3, spec.vocab_size, (n,), generator=g).tolist() for n in lens]
    pol = Policy(mu=args.mu, n=2, prefill_mu=args.mu, resident_experts=2, n_gpu_attn=n_gpu, dtype="fp32",
                 weight_quant="fp32")
    ex = CGOPipeExecutor(_host_probe_weights(spec, args.probe, torch.float32), pol, "cpu", ffn=args.ffn)
    orig = ex._micro_batches

    def micro_batches(*a, **k):  # device cpu: the first n_gpu micro-batches take the GPU attention path anyway
        mbs = orig(*a, **k)
        for i, mb in enumerate(mbs):
            mb.on_gpu = i < n_gpu
        return mbs

    ex._micro_batches = micro_batches
    return ex, prompts


def _seed(prov: Provenance, ex, mbs) -> None:
    """Tag the tensors that live on the device on CUDA (weights, page buffers, hidden states, GPU-attention caches)."""
    for obj in (ex.layers, ex.embed, ex.norm, ex.lm_head, ex.inv_freq, ex.weight_stream.buffers.buffers,
                ex.weight_stream.resident, ex.weight_stream.paging._tensor_cache):
        prov.add_all(obj)
    for mb in mbs:
        prov.add_all((mb.x, mb.pos, mb.rope))
        if mb.on_gpu:
            prov.add_all(mb.kv, depth=3)
            for name in ("lengths", "row_base", "row_cap", "rows", "group_of", "slot_of", "_all"):  # host tensors
                for t in _tensors([getattr(mb.kv, name, None)]):
                    prov._ids.pop(id(t), None)


def measure(args, n_gpu: int) -> dict:
    """Ops, syncs, host wall (and a cProfile) of one placement's decode layers."""
    from lightning_moe.pipeline.sampling import DecodeSampling

    ex, prompts = build(args, n_gpu)
    prov = Provenance()
    rec = Recorder(prov)
    layer_fn = ex._decode_layer
    walls: list[float] = []
    mode = {"count": False, "prof": None, "skip": 0}

    def decode_layer(l, mbs, *ahead):  # ahead: the executor's look-ahead of layer l, passed through
        if mode["count"] and mode["skip"] > 0:  # a decode step before the counted one
            mode["skip"] -= 1
            return layer_fn(l, mbs, *ahead)
        if mode["count"]:
            _seed(prov, ex, mbs)
            rec.active = True
            try:
                return layer_fn(l, mbs, *ahead)
            finally:
                rec.active = False
        prof = mode["prof"]
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        try:
            return layer_fn(l, mbs, *ahead)
        finally:
            if prof is not None:
                prof.disable()
            walls.append(time.perf_counter() - t0)

    ex._decode_layer = decode_layer
    # regions (innermost wins): the executor's pieces and the family's post-attention, the expert FFN inside it
    at = ex.attention
    ex._pre_attention = _region(rec, "pre_attention", ex._pre_attention)
    at.gpu = _region(rec, "attention", at.gpu)
    at.submit_cpu = _region(rec, "attention", at.submit_cpu)
    at._cpu_attention = _region(rec, "attention", at._cpu_attention, host=True)
    at.receive = _region(rec, "finish", at.receive)
    ex.weight_stream.prefetch_slot = _region(rec, "finish", ex.weight_stream.prefetch_slot)
    ex.weight_stream.begin_visit = _region(rec, "visit", ex.weight_stream.begin_visit)
    ex.weight_stream.end_visit = _region(rec, "visit", ex.weight_stream.end_visit)
    ex.family = dataclasses.replace(ex.family, post_attention=_region(rec, "post_attention", ex.family.post_attention))
    for_visit = ex.expert_ffn.for_visit
    ex.expert_ffn.for_visit = lambda lx: _region(rec, "expert_ffn", for_visit(lx))
    undo = _patch_py_syncs(rec)
    L, n_mb, steps = args.layers, 2, args.steps
    samp = lambda n: DecodeSampling(max_new_tokens=n, stop_at_eos=False)  # noqa: E731
    try:
        with torch.inference_mode():
            ex.generate(prompts, samp(3))  # warm-up
            walls.clear()
            before = ex.stats.decode_seconds
            ex.generate(prompts, samp(steps + 1))
            probe = (ex.stats.decode_seconds - before) / (steps * L * n_mb)
            layer_us = sorted(walls)[len(walls) // 2] / n_mb * 1e6  # median layer call, per micro-batch
            mode["count"], mode["skip"] = True, (args.count_step - 1) * L
            with rec:
                ex.generate(prompts, samp(args.count_step + 1))  # counts decode step count_step's L layers
            mode["count"] = False
            prof = None
            if args.profile:
                mode["prof"] = prof = cProfile.Profile()
                ex.generate(prompts, samp(steps + 1))
                mode["prof"] = None
    finally:
        for owner, name, orig in undo:
            setattr(owner, name, orig)
        ex.close()
    calls = L * 1  # the counting run counts one decode step
    per = {}
    for (region, op), c in rec.ops.items():
        per.setdefault(region, Counter())[op] += c
    out = {"n_gpu_attn": n_gpu, "ffn": args.ffn, "probe": args.probe, "count_step": args.count_step,
           "ops_per_layer_mb": sum(rec.ops.values()) / (calls * n_mb),
           "ops_by_region": {r: sum(c.values()) / (calls * n_mb) for r, c in sorted(per.items())},
           "host_us_per_layer_mb": layer_us, "probe_us_per_layer_mb": probe * 1e6,
           "device_syncs_per_layer": sum(c for (_, _, d), c in rec.syncs.items() if d) / calls,
           "host_reads_per_layer": sum(c for (_, _, d), c in rec.syncs.items() if not d) / calls,
           "sync_sites": [{"kind": k, "site": s, "device": d, "per_layer": c / calls}
                          for (k, s, d), c in sorted(rec.syncs.items(), key=lambda kv: -kv[1])],
           "top_ops": {r: c.most_common(args.top) for r, c in per.items()}}
    if prof is not None:
        out["profile"] = prof
    return out


def report(res: dict, args) -> None:
    """Print one placement's numbers."""
    where = "GPU-attention path" if res["n_gpu_attn"] else "CPU attention"
    print(f"\n== {where} micro-batches (n_gpu_attn={res['n_gpu_attn']}, ffn={res['ffn']}{', probe ' + res['probe']}, "
          f"decode step {res['count_step']} counted)")
    print(f"ATen ops per layer per micro-batch: {res['ops_per_layer_mb']:.1f}  "
          + "  ".join(f"{r} {n:.1f}" for r, n in res["ops_by_region"].items()))
    print(f"host us per layer per micro-batch: {res['host_us_per_layer_mb']:.0f} (_decode_layer, median), "
          f"{res['probe_us_per_layer_mb']:.0f} (measure_host_issue's definition)")
    print(f"device syncs per layer: {res['device_syncs_per_layer']:.1f}  (host-tensor reads: "
          f"{res['host_reads_per_layer']:.1f})")
    if args.sites:
        for s in res["sync_sites"]:
            print(f"  {'DEVICE' if s['device'] else 'host  '} {s['per_layer']:5.1f}/layer  {s['kind']:<28} {s['site']}")
    if args.ops:
        for r, ops in res["top_ops"].items():
            print(f"  [{r}] " + ", ".join(f"{o} {c}" for o, c in ops))
    if "profile" in res:
        st = pstats.Stats(res.pop("profile"))
        st.sort_stats("tottime").print_stats(args.top)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the probe model (default 8)")
    p.add_argument("--mu", type=int, default=64, help="rows per micro-batch (default 64; 2 micro-batches)")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed (default 8)")
    p.add_argument("--count-step", type=int, default=1,
                   help="the decode step whose ops are counted (default 1, the first: what a run makes once per "
                        "step or per cache, e.g. the length groups' masks and cut views, is counted there; 2 or "
                        "later: the steady state)")
    p.add_argument("--ffn", default="torch", help="expert FFN: torch (the CPU default), grouped_mm or mm_loop")
    p.add_argument("--gpu-attn", type=int, nargs="+", default=[0, 2], help="n_gpu_attn values (default 0 2)")
    p.add_argument("--probe", default="generic", help="the host probe: generic (default) or a key of "
                   "profiler.host_probe_keys (mla, qwen3_moe, mixtral/int4, gpt_oss/mxfp4, ...)")
    p.add_argument("--mla", action="store_true", help="--probe mla: the DeepSeek-V2-shaped probe (latent cache)")
    p.add_argument("--sites", action="store_true", help="list every sync-capable call site")
    p.add_argument("--ops", action="store_true", help="the most frequent ATen ops per region")
    p.add_argument("--profile", action="store_true", help="cProfile of _decode_layer (own time)")
    p.add_argument("--top", type=int, default=20, help="rows of the op and cProfile tables (default 20)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args(argv)
    args.probe = "mla" if args.mla else args.probe
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for n_gpu in args.gpu_attn:
        res = measure(args, n_gpu)
        report(res, args)
        results.append({k: v for k, v in res.items() if k not in ("profile", "top_ops")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
