#!/usr/bin/env python3
"""Measured GPU bytes of one prefill chunk's stages against the memory model's terms (policy/hrm.py).

One Mixtral-width decoder layer with random bf16 weights on the GPU; for each chunk shape (rows x longest, equal
lengths) it runs what CGOPipe's prefill runs for a chunk and reads ``torch.cuda.max_memory_allocated`` above the
chunk's input hidden states (which the model counts under "packed rows"):

  attention   ``pre_attention`` + ``prefill_attention_packed``        model: q/k/v + packed attention
  ffn (1)     + ``post_attention`` with one grouped Triton call         model: q/k/v + FFN stage, one expert group
  ffn (2)     the same with the experts split into two groups (paged + resident, as dense pages with residents run)
  head        ``token_scores`` over the chunk (scoring jobs)          model: ``score_head_bytes``

Each figure is printed next to the model's, with their ratio. It locates which term of the model is off when a
phase's measured peak and the prediction disagree (the run reports give one peak per phase, not per component).

  python3 benchmarks/memory_probe.py --out $OUT/memory_probe.md          # GPU host
  python3 benchmarks/memory_probe.py --cases 157x208,16x2000           # chosen shapes
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from lightning_moe.model.families import family_for  # noqa: E402
from lightning_moe.model.layers import ExpertWeights  # noqa: E402
from lightning_moe.model.spec import MoESpec  # noqa: E402
from lightning_moe.policy import hrm  # noqa: E402

M = family_for({"model_type": "mixtral"})  # the Mixtral family's layer math (model/families/)

DEFAULT_CASES = "157x208,320x102,109x300,16x2000,64x512,78x208,1x32768"


def mixtral_width_spec() -> MoESpec:
    from transformers import MixtralConfig

    cfg = MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
                        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                        max_position_embeddings=32768)
    return MoESpec.from_hf_config(cfg, name="mixtral-width-1L")


def random_layer(spec: MoESpec, dev, dtype):
    D, hd = spec.hidden_size, spec.head_dim
    r = lambda *s: torch.randn(*s, device=dev, dtype=dtype) * 0.02  # noqa: E731
    lw = M.layer_weights(attn_norm=torch.ones(D, device=dev, dtype=dtype), wq=r(spec.num_heads * hd, D),
                        wk=r(spec.num_kv_heads * hd, D), wv=r(spec.num_kv_heads * hd, D), wo=r(D, spec.num_heads * hd),
                        ffn_norm=torch.ones(D, device=dev, dtype=dtype), router=r(spec.num_experts, D))
    E, F = spec.num_experts, spec.intermediate_size
    ew = ExpertWeights(r(E, F, D), r(E, F, D), r(E, D, F))
    return lw, ew


def ffn_fns(ew, split: int):
    """The grouped Triton FFN as CGOPipe calls it: one call over every expert (split 0), or two calls, experts
    [0, split) and [split, E), each skipping the other's slots, summed (dense pages with resident experts)."""
    from lightning_moe.kernels.fused_moe import fused_experts_triton

    if not split:
        return lambda h, _ew, w, ids: fused_experts_triton(h, ew.w1, ew.w3, ew.w2, w, ids, validate=False)
    groups = [(0, split), (split, ew.w1.shape[0])]

    def two(h, _ew, w, ids):
        out = None
        for a, b in groups:
            local = torch.where((ids >= a) & (ids < b), ids - a, torch.full_like(ids, b - a))
            y = fused_experts_triton(h, ew.w1[a:b], ew.w3[a:b], ew.w2[a:b], w, local, validate=False, skip=True)
            out = y if out is None else out + y
        return out

    return two


def peak_above(fn, base: int) -> tuple[int, object]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def probe(spec, lw, ew, rows: int, longest: int, dev, dtype, head) -> dict:
    from lightning_moe.pipeline.token_scores import token_scores

    T = rows * longest
    spans = [(i * longest, (i + 1) * longest) for i in range(rows)]
    x = torch.randn(T, spec.hidden_size, device=dev, dtype=dtype)  # the chunk's input rows (not measured)
    pos = torch.cat([torch.arange(longest) for _ in range(rows)]).to(dev)
    inv_freq = M.rope_inv_freq(spec, dev)
    rope = M.rope_cos_sin(spec, pos, inv_freq, dtype)
    layout = M.prefill_packed_layout(spans, T, dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

    def attention():
        q, k, v = M.pre_attention(lw, x, pos, spec, inv_freq, rope)
        return q, k, v, M.prefill_attention_packed(q, k, v, spans, spec.sliding_window, layout)

    attn_peak, (q, k, v, attn) = peak_above(attention, base)
    row = {"rows": rows, "longest": longest, "T": T, "attention": attn_peak}
    for name, split in (("ffn1", 0), ("ffn2", spec.num_experts - 2)):
        ffn = ffn_fns(ew, split)
        peak, out = peak_above(lambda ffn=ffn, attn=attn: M.post_attention(lw, None, x, attn, spec, ffn), base)
        row[name] = peak
        del out
    del q, k, v, attn
    norm, lm_head = head
    targets = torch.randint(0, spec.vocab_size, (T,), device=dev)
    row["head"], _ = peak_above(lambda: token_scores(x, norm, lm_head, spec.rms_norm_eps, targets), base)
    b = 2
    qkv = T * (spec.attn_query_elems + spec.kv_elems_per_token) * b
    row["m_attention"] = qkv + hrm._packed_attention_stage_bytes(spec, T, rows * longest, longest, "bf16")
    row["m_ffn2"] = qkv + hrm._ffn_stage_bytes(spec, T, "bf16", groups=2)
    row["m_ffn1"] = qkv + hrm._ffn_stage_bytes(spec, T, "bf16", groups=1)
    row["m_head"] = hrm.score_head_bytes(spec, T, "bf16")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated ROWSxLONGEST chunk shapes")
    ap.add_argument("--out", default=None, help="write the table here (markdown) as well")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("memory_probe: needs CUDA (it reads the caching allocator's peak)", file=sys.stderr)
        return 2
    dev, dtype = torch.device("cuda"), torch.bfloat16
    spec = mixtral_width_spec()
    lw, ew = random_layer(spec, dev, dtype)
    head = (torch.ones(spec.hidden_size, device=dev, dtype=dtype),
            torch.randn(spec.vocab_size, spec.hidden_size, device=dev, dtype=dtype) * 0.02)
    cases = [tuple(int(v) for v in c.split("x")) for c in a.cases.split(",") if c]
    probe(spec, lw, ew, 4, 64, dev, dtype, head)  # warm-up: Triton compiles, cuBLAS workspaces
    lines = ["| rows x longest | T | stage | measured MiB | model MiB | model / measured | measured KiB/token |",
             "|---|---|---|---|---|---|---|"]
    for rows, longest in cases:
        r = probe(spec, lw, ew, rows, longest, dev, dtype, head)
        for st in ("attention", "ffn1", "ffn2", "head"):
            meas, mod = r[st], r["m_" + st]
            lines.append(f"| {rows} x {longest} | {r['T']} | {st} | {meas / 2**20:,.1f} | {mod / 2**20:,.1f} | "
                         f"{mod / max(meas, 1):.3f} | {meas / r['T'] / 1024:.1f} |")
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write("# memory_probe\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
