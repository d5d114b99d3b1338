"""Native CPU decode attention over a ragged KV cache, with the new token's K/V appended in the same pass.

Why a kernel of our own: PyTorch's fused CPU attention (``scaled_dot_product_attention``) pays a large fixed cost
per (row, KV head) at decode shapes (one query of G = Hq / Hkv heads against a few hundred positions): on the
H200 host it read 15-25 GB/s of K/V inside CGOPipe at MT-Bench lengths, and the gather / index_put /
pin copies around it cost as much again, against ~55 GB/s for one long contiguous call. Decode attention is a
memory-bound stream (arithmetic intensity ~G FLOP per byte, MoE-Lightning Sec. 4.1 / Fig. 3), so the kernel here
reads each valid K and V row of the cache exactly once and does everything else in registers / L1:

    for each (row b, KV head h)                   [parallel over B_g * Hkv: OpenMP, dynamic schedule, chunks of 4]
        K[b, h, L_b] = k_new[rows[b], h];  V[b, h, L_b] = v_new[rows[b], h]        (append; L_b = lengths[b])
        s[g, j]  = (q[rows[b], h*G + g] / sqrt(hd)) . K[b, h, j]        j in [max(0, L_b + 1 - W), L_b + 1)
        p[g, :]  = softmax(s[g, :])          (fp32; with sinks: over s[g, :] and sink[h*G + g], its share dropped)
        out[rows[b], h*G + g] = sum_j p[g, j] V[b, h, j]                               (fp32 accumulate)

in fp32 arithmetic for bf16 / fp16 / fp32 storage (scores and softmax in fp32; the result rounded once to the
storage dtype). The output rows go straight to ``out`` (e.g. a pinned buffer the executor copies to the GPU), so
no gather of q, no scatter of the output and no separate pinning copy remain.

The C++ source is compiled on first use with ``torch.utils.cpp_extension.load_inline`` (a C++ compiler is
needed, g++ / clang with OpenMP, and ninja; ~30-60 s once, cached in torch's extensions directory). Where it cannot be built, or with
``LIGHTNING_MOE_CPU_ATTENTION=sdpa``, :func:`native_available` is False and callers use the PyTorch routine
(pipeline.cpu_attention.cpu_decode_attention). The pure-torch reference :func:`decode_attention_append_reference`
sits beside the kernel (append by indexing + decode_attention_torch, which model.layers uses as the families' decode attention).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from typing import Optional, Sequence

import torch

log = logging.getLogger(__name__)

_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace {

// storage types: raw element + conversions to / from fp32 (bf16: a 16-bit shift, which vectorizes)
struct F32 {
  using raw = float;
  static inline float f(float x) { return x; }
  static inline float to(float x) { return x; }
};
struct BF16 {
  using raw = uint16_t;
  static inline float f(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float y;
    std::memcpy(&y, &u, 4);
    return y;
  }
  static inline uint16_t to(float x) { return c10::BFloat16(x).x; }
};
struct F16 {
  using raw = c10::Half;
  static inline float f(c10::Half x) { return static_cast<float>(x); }
  static inline c10::Half to(float x) { return c10::Half(x); }
};

// exp(x) for the softmax (x <= 0 there; any finite x works): 2^k e^r, k = round(x log2 e), r = x - k ln 2, e^r by Cephes' expf polynomial (|r| <= ln2 / 2, ~1 ulp); x clamped to [-87.3, 88.3] (e^-87.3 ~ 1e-38 stands
// for 0 beside a softmax's largest term, 1). Branch-free, so a loop of it vectorizes (std::exp is a libm call per
// element: at head width 64 a score's exp cost more than its 128 multiply-adds).
inline float exp_fast(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float t = x * 1.44269504088896341f;
  const int32_t ki = static_cast<int32_t>(t + (t >= 0.f ? 0.5f : -0.5f));  // round half away from zero
  const float k = static_cast<float>(ki);
  // in double: the build's -fassociative-math may fold a two-part (Cody-Waite) ln 2 into one float constant
  const float r = static_cast<float>(static_cast<double>(x) - static_cast<double>(k) * 0.6931471805599453);
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(ki + 127) << 23;
  float p;
  std::memcpy(&p, &bits, 4);
  return y * p;
}

#ifdef __AVX512F__
constexpr int CH = 64;  // output columns per query head kept in registers in the V pass (4 heads x 64 = 16 zmm)
#else
constexpr int CH = 16;  // (4 heads x 16 = 8 ymm)
#endif

// scores s[g*n + j] = q_g . K_j for GB query heads (q pre-scaled, fp32); each K row read once per head block.
// HD > 0: the head dim as a compile-time constant (fully unrolled, no loop tails); HD == 0: runtime hd.
template <typename Tr, int GB, int HD>
inline void qk(const float* __restrict qf, int64_t hd_rt, const typename Tr::raw* __restrict Kj0, int64_t n,
               float* __restrict s) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {  // two positions at a time: 2 * GB independent sums
    const typename Tr::raw* __restrict k0 = Kj0 + j * hd;
    const typename Tr::raw* __restrict k1 = k0 + hd;
    float a[GB], b[GB];
    for (int g = 0; g < GB; ++g) a[g] = b[g] = 0.f;
    for (int64_t d = 0; d < hd; ++d) {
      const float x0 = Tr::f(k0[d]), x1 = Tr::f(k1[d]);
      for (int g = 0; g < GB; ++g) {
        a[g] += qf[g * hd + d] * x0;
        b[g] += qf[g * hd + d] * x1;
      }
    }
    for (int g = 0; g < GB; ++g) {
      s[g * n + j] = a[g];
      s[g * n + j + 1] = b[g];
    }
  }
  for (; j < n; ++j) {
    const typename Tr::raw* __restrict k0 = Kj0 + j * hd;
    float a[GB];
    for (int g = 0; g < GB; ++g) a[g] = 0.f;
    for (int64_t d = 0; d < hd; ++d) {
      const float x0 = Tr::f(k0[d]);
      for (int g = 0; g < GB; ++g) a[g] += qf[g * hd + d] * x0;
    }
    for (int g = 0; g < GB; ++g) s[g * n + j] = a[g];
  }
}

// acc[g*hd + d] = sum_j p[g*n + j] V_j[d] for GB heads: CH columns at a time stay in registers over all j
template <typename Tr, int GB, int HD>
inline void pv(const float* __restrict p, int64_t n, const typename Tr::raw* __restrict Vj0, int64_t hd_rt,
               float* __restrict acc) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  int64_t d0 = 0;
  for (; d0 + CH <= hd; d0 += CH) {
    float a[GB][CH];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < CH; ++c) a[g][c] = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const typename Tr::raw* __restrict vr = Vj0 + j * hd + d0;
      float v[CH];
      for (int c = 0; c < CH; ++c) v[c] = Tr::f(vr[c]);
      for (int g = 0; g < GB; ++g) {
        const float w = p[g * n + j];
        for (int c = 0; c < CH; ++c) a[g][c] += w * v[c];
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < CH; ++c) acc[g * hd + d0 + c] = a[g][c];
  }
  for (; d0 < hd; ++d0) {  // tail columns (hd not a multiple of CH)
    for (int g = 0; g < GB; ++g) {
      float a = 0.f;
      for (int64_t j = 0; j < n; ++j) a += p[g * n + j] * Tr::f(Vj0[j * hd + d0]);
      acc[g * hd + d0] = a;
    }
  }
}

// sink: nullptr, or the GB heads' sink logits (gpt-oss): each head's softmax also counts exp(sink - m), whose share
// of the probability goes to no position
template <typename Tr, int GB, int HD>
inline void head_block(const typename Tr::raw* q, const typename Tr::raw* Kb, const typename Tr::raw* Vb,
                       typename Tr::raw* o, int64_t n, int64_t hd, float scale, const float* sink, float* qf,
                       float* scores, float* acc) {
  for (int g = 0; g < GB; ++g)
    for (int64_t d = 0; d < hd; ++d) qf[g * hd + d] = Tr::f(q[g * hd + d]) * scale;
  qk<Tr, GB, HD>(qf, hd, Kb, n, scores);
  for (int g = 0; g < GB; ++g) {  // softmax in fp32
    float* sg = scores + g * n;
    float m = sink ? sink[g] : -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) m = std::max(m, sg[j]);
    float sum = sink ? exp_fast(sink[g] - m) : 0.f;
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = exp_fast(sg[j] - m);
      sum += sg[j];
    }
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  pv<Tr, GB, HD>(scores, n, Vb, hd, acc);
  for (int g = 0; g < GB; ++g)
    for (int64_t d = 0; d < hd; ++d) o[g * hd + d] = Tr::to(acc[g * hd + d]);
}

// the query heads of one KV head in blocks of 4, 2, 1
template <typename Tr, int HD>
inline void heads(const typename Tr::raw* q, const typename Tr::raw* Ks, const typename Tr::raw* Vs,
                  typename Tr::raw* o, int64_t G, int64_t n, int64_t hd, float scale, const float* sink, float* qf,
                  float* scores, float* acc) {
  int64_t g = 0;
  auto sk = [&](int64_t g0) { return sink ? sink + g0 : nullptr; };
  for (; g + 4 <= G; g += 4) head_block<Tr, 4, HD>(q + g * hd, Ks, Vs, o + g * hd, n, hd, scale, sk(g), qf, scores, acc);
  for (; g + 2 <= G; g += 2) head_block<Tr, 2, HD>(q + g * hd, Ks, Vs, o + g * hd, n, hd, scale, sk(g), qf, scores, acc);
  for (; g < G; ++g) head_block<Tr, 1, HD>(q + g * hd, Ks, Vs, o + g * hd, n, hd, scale, sk(g), qf, scores, acc);
}

// one cache group's pointers and strides (a length group of the grouped KV cache)
template <typename raw>
struct Group {
  raw* K;
  raw* V;
  const int64_t* rows;  // caller row of each cache row
  const int64_t* lens;  // positions cached per cache row
  int64_t Bg;  // cache rows
  int64_t c_row, c_head;  // cache strides: row, head (positions of one head are contiguous rows of hd)
};

constexpr int64_t kGrainBytes = 256 * 1024;  // K/V bytes per team thread, at least (attend_groups' team size)

// one (cache row b, KV head h) item: append the new K/V (optional), attend over the valid positions
template <typename Tr>
inline void attend_item(const Group<typename Tr::raw>& gr, int64_t b, int64_t h, const typename Tr::raw* q,
                        const typename Tr::raw* k_new, const typename Tr::raw* v_new, typename Tr::raw* out,
                        int64_t G, int64_t hd, int64_t window, bool append, int64_t q_row, int64_t kn_row,
                        int64_t out_row, float scale, const float* sinks, float* qf, std::vector<float>& scores,
                        float* acc) {
  using raw = typename Tr::raw;
  const int64_t r = gr.rows[b], L = gr.lens[b];
  raw* Kb = gr.K + b * gr.c_row + h * gr.c_head;
  raw* Vb = gr.V + b * gr.c_row + h * gr.c_head;
  if (append) {
    std::memcpy(Kb + L * hd, k_new + r * kn_row + h * hd, hd * sizeof(raw));
    std::memcpy(Vb + L * hd, v_new + r * kn_row + h * hd, hd * sizeof(raw));
  }
  const int64_t stop = append ? L + 1 : L;
  const int64_t start = window > 0 ? std::max<int64_t>(0, stop - window) : 0;
  const int64_t n = stop - start;
  scores.resize(4 * n);
  const raw* Ks = Kb + start * hd;
  const raw* Vs = Vb + start * hd;
  const raw* qh = q + r * q_row + h * G * hd;
  raw* oh = out + r * out_row + h * G * hd;
  const float* sh = sinks ? sinks + h * G : nullptr;  // this KV head's G query heads' sinks
  if (hd == 128)
    heads<Tr, 128>(qh, Ks, Vs, oh, G, n, hd, scale, sh, qf, scores.data(), acc);
  else if (hd == 64)  // gpt-oss
    heads<Tr, 64>(qh, Ks, Vs, oh, G, n, hd, scale, sh, qf, scores.data(), acc);
  else
    heads<Tr, 0>(qh, Ks, Vs, oh, G, n, hd, scale, sh, qf, scores.data(), acc);
}

// Where the wall time of a call goes (native_stats): one parallel region per call; per team thread the time from
// the region's start to its first item (wake-up lag: a thread not on a core yet), and from its last item to the
// region's end (the tail: waiting for the slowest thread). Accumulated over calls in nanoseconds.
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
struct RegionStats {
  std::atomic<int64_t> calls{0}, region_ns{0}, team_ns{0}, busy_ns{0}, lag_max_ns{0}, tail_ns{0}, threads{0};
};
RegionStats g_stats;

void record_region(int64_t t0, int64_t t1, int team, const std::vector<int64_t>& t_start,
                   const std::vector<int64_t>& t_end) {
  int64_t busy = 0, lag = 0, first_done = t1;
  for (int i = 0; i < team && i < static_cast<int>(t_start.size()); ++i) {
    if (t_start[i] < 0 || t_end[i] < 0) continue;
    busy += t_end[i] - t_start[i];
    lag = std::max(lag, t_start[i] - t0);
    first_done = std::min(first_done, t_end[i]);
  }
  g_stats.calls += 1;
  g_stats.region_ns += t1 - t0;
  g_stats.team_ns += (t1 - t0) * team;
  g_stats.busy_ns += busy;
  g_stats.lag_max_ns += lag;
  g_stats.tail_ns += t1 - first_done;
  g_stats.threads += team;
}

std::vector<double> native_stats(bool reset) {
  std::vector<double> v{static_cast<double>(g_stats.calls.load()), g_stats.region_ns.load() * 1e-9,
                        g_stats.team_ns.load() * 1e-9, g_stats.busy_ns.load() * 1e-9,
                        g_stats.lag_max_ns.load() * 1e-9, g_stats.tail_ns.load() * 1e-9,
                        static_cast<double>(g_stats.threads.load())};
  if (reset) {
    g_stats.calls = 0; g_stats.region_ns = 0; g_stats.team_ns = 0; g_stats.busy_ns = 0;
    g_stats.lag_max_ns = 0; g_stats.tail_ns = 0; g_stats.threads = 0;
  }
  return v;
}

// every (group, cache row, KV head) item of ALL groups in one parallel region, longest rows first: one fork/join
// per CPU micro-batch and layer instead of one per group, and the longest items start first so the last ones to
// finish are short (longest-processing-time order). Items are handed out dynamically: a thread that shares its
// core with the host thread or a spinning CUDA sync takes fewer items instead of holding up the call (static
// chunks make every call wait for the slowest thread). Team size: torch's intra-op thread count.
template <typename Tr>
void attend_groups(const std::vector<Group<typename Tr::raw>>& groups, const typename Tr::raw* q,
                   const typename Tr::raw* k_new, const typename Tr::raw* v_new, typename Tr::raw* out, int64_t Hkv,
                   int64_t G, int64_t hd, int64_t window, bool append, int64_t q_row, int64_t kn_row,
                   int64_t out_row, const float* sinks) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<std::pair<int64_t, int64_t>> order;  // (-attended length, group << 32 | cache row)
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g)
    for (int64_t b = 0; b < groups[g].Bg; ++b) order.emplace_back(-groups[g].lens[b], (g << 32) | b);
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  const int64_t items = static_cast<int64_t>(order.size()) * Hkv;
  // Team size: torch's intra-op threads, at most one per item and one per kGrainBytes of K/V the call reads. A
  // small call (a tiny model, a few short rows) runs on fewer threads: there, starting and joining a team costs
  // more than it saves, and one team thread that loses its core to another process stalls the whole call. Decode calls at real sizes
  // read megabytes and keep the whole team.
  int64_t kv_bytes = 0;
  for (const auto& gr : groups)
    for (int64_t b = 0; b < gr.Bg; ++b) kv_bytes += (gr.lens[b] + 1) * Hkv * hd * 2 * static_cast<int64_t>(sizeof(typename Tr::raw));
  const int64_t by_work = std::max<int64_t>(1, kv_bytes / kGrainBytes);
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(std::min<int64_t>(at::get_num_threads(), items), by_work)));
  std::vector<int64_t> t_start(nt, -1), t_end(nt, -1);  // per team thread: first item taken, own items done (ns)
  int team = 1;
  const int64_t t0 = now_ns();
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    t_start[tid] = now_ns();
    if (tid == 0) team = omp_get_num_threads();
    std::vector<float> qf(4 * hd), acc(4 * hd), scores;
#pragma omp for schedule(dynamic, 2) nowait
    for (int64_t i = 0; i < items; ++i) {
      const int64_t key = order[i / Hkv].second, h = i % Hkv;
      attend_item<Tr>(groups[key >> 32], key & 0xffffffffLL, h, q, k_new, v_new, out, G, hd, window, append, q_row,
                      kn_row, out_row, scale, sinks, qf.data(), scores, acc.data());
    }
    t_end[tid] = now_ns();
  }
  const int64_t t1 = now_ns();
  record_region(t0, t1, team, t_start, t_end);
}

// the checks of the index values (rows in [0, B) and distinct, lengths within the cache), in one pass over them before
// anything is written: "" when they hold, else the message (the Python wrapper raises ValueError with it). Here
// rather than as tensor ops in Python: the wrapper runs once per CPU micro-batch and layer, and ~40 small tensor ops
// cost ~1 ms per call there.
// pos_dim: the caches' position dimension (2 for K [B_g, Hkv, S, hd], 1 for MLA's latents [B_g, S, Dl + rd])
std::string check_indices(const std::vector<at::Tensor>& rows, const std::vector<at::Tensor>& K,
                          const std::vector<at::Tensor>& lens, int64_t B, bool append, int64_t pos_dim = 2) {
  std::vector<char> seen(static_cast<size_t>(std::max<int64_t>(B, 0)), 0);
  for (size_t g = 0; g < K.size(); ++g) {
    const std::string where = K.size() > 1 ? " (group " + std::to_string(g) + ")" : "";
    const int64_t Bg = K[g].size(0), S = K[g].size(pos_dim);
    if (Bg == 0) continue;
    const int64_t* r = rows[g].data_ptr<int64_t>();
    const int64_t* n = lens[g].data_ptr<int64_t>();
    int64_t rlo = r[0], rhi = r[0], lo = n[0], hi = n[0];
    for (int64_t b = 1; b < Bg; ++b) {
      rlo = std::min(rlo, r[b]); rhi = std::max(rhi, r[b]);
      lo = std::min(lo, n[b]); hi = std::max(hi, n[b]);
    }
    if (rlo < 0 || rhi >= B)
      return where + ": rows must lie in [0, " + std::to_string(B) + "), got [" + std::to_string(rlo) + ", " +
             std::to_string(rhi) + "]";
    if ((append && (lo < 0 || hi >= S)) || (!append && (lo < 1 || hi > S)))
      return where + ": lengths in [" + std::to_string(lo) + ", " + std::to_string(hi) + "] do not fit a cache of " +
             std::to_string(S) + " positions (" +
             (append ? "append needs 0 <= length < S" : "need 1 <= length <= S") + ")";
    for (int64_t b = 0; b < Bg; ++b) {
      if (seen[r[b]]) return ": a caller row appears twice in rows (each output row has one writer)";
      seen[r[b]] = 1;
    }
  }
  return "";
}

// groups: K, V [B_g, Hkv, S_g, hd], rows and lens int64 [B_g] per group; shapes / dtypes / contiguity are checked
// by the Python wrapper, index values here (check_indices). Returns "" or the message of a failed index check.
std::string decode_attention_append_groups(at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                                           std::vector<at::Tensor> rows, std::vector<at::Tensor> K,
                                           std::vector<at::Tensor> V, std::vector<at::Tensor> lens, at::Tensor out,
                                           int64_t window, bool append, at::Tensor sinks) {
  TORCH_CHECK(!K.empty() && K.size() == V.size() && K.size() == rows.size() && K.size() == lens.size(),
              "decode_attention_append_groups: one K, V, rows and lengths tensor per group");
  const std::string bad = check_indices(rows, K, lens, q.size(0), append);
  if (!bad.empty()) return bad;
  const int64_t Hkv = K[0].size(1), hd = K[0].size(3);
  const int64_t G = q.size(1) / Hkv;
  const int64_t q_row = q.stride(0), kn_row = k_new.stride(0), out_row = out.stride(0);
  const float* sk = sinks.numel() ? sinks.data_ptr<float>() : nullptr;  // fp32 [Hq] (checked by the wrapper) or none
  auto run = [&](auto tr) {
    using Tr = decltype(tr);
    using raw = typename Tr::raw;
    std::vector<Group<raw>> groups;
    for (size_t g = 0; g < K.size(); ++g)  // V has K's strides (checked by the wrapper)
      groups.push_back({static_cast<raw*>(K[g].data_ptr()), static_cast<raw*>(V[g].data_ptr()),
                        rows[g].data_ptr<int64_t>(), lens[g].data_ptr<int64_t>(), K[g].size(0), K[g].stride(0),
                        K[g].stride(1)});
    attend_groups<Tr>(groups, static_cast<const raw*>(q.data_ptr()), static_cast<const raw*>(k_new.data_ptr()),
                      static_cast<const raw*>(v_new.data_ptr()), static_cast<raw*>(out.data_ptr()), Hkv, G, hd,
                      window, append, q_row, kn_row, out_row, sk);
  };
  switch (K[0].scalar_type()) {
    case at::kFloat: run(F32()); break;
    case at::kBFloat16: run(BF16()); break;
    case at::kHalf: run(F16()); break;
    default: TORCH_CHECK(false, "decode_attention_append_groups: unsupported dtype ", K[0].scalar_type());
  }
  return "";
}

// ---- MLA (DeepSeek multi-head latent attention) decode over the latent cache -------------------------------------
// Every query head attends to ONE shared key row X_j = [c_j, k_pe_j] (width E = Dl + rd) per position; the value is
// its first Dl entries. So one cache row feeds all Hq heads (one KV head, G = Hq): the kernel reads each row once per
// item (all of the item's heads) in tiles of LT positions, a tile staying in L1/L2 while every head block uses it,
// with an online softmax (flash-decoding) so no pass over the positions repeats.

constexpr int64_t LT = 32;  // positions per tile (32 x 576 bf16 = 36 KB)

// acc[g*Dl + d] += sum_j p[g*t + j] X_j[d], d < Dl, for GB heads over t positions (rows of E elements)
template <typename Tr, int GB>
inline void lat_pv(const float* __restrict p, int64_t t, const typename Tr::raw* __restrict X, int64_t E, int64_t Dl,
                   float* __restrict acc) {
  int64_t d0 = 0;
  for (; d0 + CH <= Dl; d0 += CH) {
    float a[GB][CH];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < CH; ++c) a[g][c] = acc[g * Dl + d0 + c];
    for (int64_t j = 0; j < t; ++j) {
      const typename Tr::raw* __restrict xr = X + j * E + d0;
      float v[CH];
      for (int c = 0; c < CH; ++c) v[c] = Tr::f(xr[c]);
      for (int g = 0; g < GB; ++g) {
        const float w = p[g * t + j];
        for (int c = 0; c < CH; ++c) a[g][c] += w * v[c];
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < CH; ++c) acc[g * Dl + d0 + c] = a[g][c];
  }
  for (; d0 < Dl; ++d0) {  // tail columns (Dl not a multiple of CH)
    for (int g = 0; g < GB; ++g) {
      float a = acc[g * Dl + d0];
      for (int64_t j = 0; j < t; ++j) a += p[g * t + j] * Tr::f(X[j * E + d0]);
      acc[g * Dl + d0] = a;
    }
  }
}

// one tile of t positions for GB heads: scores (qk, q pre-scaled), the online softmax update of the running max m,
// sum l and accumulator acc (rescaled by exp(m_old - m_new); the first tile's factor is exp(-inf) = 0), then p X
template <typename Tr, int GB, int E_>
inline void lat_block(const float* qf, const typename Tr::raw* Xt, int64_t t, int64_t E, int64_t Dl, float* m,
                      float* l, float* acc, float* s) {
  qk<Tr, GB, E_>(qf, E, Xt, t, s);  // s[g*t + j]
  for (int g = 0; g < GB; ++g) {
    float* sg = s + g * t;
    float mx = m[g];
    for (int64_t j = 0; j < t; ++j) mx = std::max(mx, sg[j]);
    const float alpha = std::exp(m[g] - mx);
    float sum = 0.f;
    for (int64_t j = 0; j < t; ++j) {
      sg[j] = std::exp(sg[j] - mx);
      sum += sg[j];
    }
    l[g] = l[g] * alpha + sum;
    m[g] = mx;
    if (alpha != 1.f)
      for (int64_t d = 0; d < Dl; ++d) acc[g * Dl + d] *= alpha;
  }
  lat_pv<Tr, GB>(s, t, Xt, E, Dl, acc);
}

// one cache group of latents: [B_g, S_g, E], each position's E elements contiguous
template <typename raw>
struct LatGroup {
  raw* X;
  const int64_t* rows;  // caller row of each cache row
  const int64_t* lens;  // positions cached per cache row
  int64_t Bg, c_row;  // cache rows, row stride
};

struct LatScratch {  // one team thread's buffers: the item's pre-scaled queries, accumulators, softmax state, scores
  std::vector<float> qf, acc, m, l, s;
};

// one item: cache row b, query heads [h0, h0 + nh) (the new row already appended): n = L (+1) positions in tiles
template <typename Tr, int E_>
void lat_item(const LatGroup<typename Tr::raw>& gr, int64_t b, int64_t h0, int64_t nh, const typename Tr::raw* q,
              typename Tr::raw* out, int64_t E, int64_t Dl, bool append, int64_t q_row, int64_t out_row, float scale,
              LatScratch& w) {
  using raw = typename Tr::raw;
  const int64_t r = gr.rows[b], n = gr.lens[b] + (append ? 1 : 0);
  const raw* X = gr.X + b * gr.c_row;
  const raw* qh = q + r * q_row + h0 * E;
  for (int64_t i = 0; i < nh * E; ++i) w.qf[i] = Tr::f(qh[i]) * scale;
  std::fill(w.m.begin(), w.m.begin() + nh, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + nh, 0.f);
  std::fill(w.acc.begin(), w.acc.begin() + nh * Dl, 0.f);
  for (int64_t j0 = 0; j0 < n; j0 += LT) {
    const int64_t t = std::min(LT, n - j0);
    const raw* Xt = X + j0 * E;
    int64_t h = 0;
    for (; h + 4 <= nh; h += 4)
      lat_block<Tr, 4, E_>(&w.qf[h * E], Xt, t, E, Dl, &w.m[h], &w.l[h], &w.acc[h * Dl], w.s.data());
    for (; h + 2 <= nh; h += 2)
      lat_block<Tr, 2, E_>(&w.qf[h * E], Xt, t, E, Dl, &w.m[h], &w.l[h], &w.acc[h * Dl], w.s.data());
    for (; h < nh; ++h) lat_block<Tr, 1, E_>(&w.qf[h * E], Xt, t, E, Dl, &w.m[h], &w.l[h], &w.acc[h * Dl], w.s.data());
  }
  raw* o = out + r * out_row + h0 * Dl;
  for (int64_t h = 0; h < nh; ++h) {
    const float inv = 1.f / w.l[h];
    for (int64_t d = 0; d < Dl; ++d) o[h * Dl + d] = Tr::to(w.acc[h * Dl + d] * inv);
  }
}

// Items: (cache row, block of hc query heads), longest rows first, handed out dynamically (attend_groups' reasons).
// hc = Hq unless there are too few rows for the team (DeepSeek-V3's 128 heads over a few rows): then the heads are
// split in blocks of >= 16, each block reading the row once. The appends run first (one omp for, its barrier before
// any item reads a row). Team size: torch's intra-op threads, at most one per item and per kGrainBytes of work
// (cache bytes x Hq / 8: an MLA position costs Hq heads' FLOPs per byte, ~G / 8 times a GQA position's).
template <typename Tr>
void latent_groups(const std::vector<LatGroup<typename Tr::raw>>& groups, const typename Tr::raw* q,
                   const typename Tr::raw* c_new, const typename Tr::raw* kpe_new, typename Tr::raw* out, int64_t Hq,
                   int64_t E, int64_t Dl, bool append, int64_t q_row, int64_t c_row, int64_t kpe_row,
                   int64_t out_row, float scale) {
  using raw = typename Tr::raw;
  std::vector<std::pair<int64_t, int64_t>> order;  // (-length, group << 32 | cache row)
  int64_t bytes = 0;
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g)
    for (int64_t b = 0; b < groups[g].Bg; ++b) {
      order.emplace_back(-groups[g].lens[b], (g << 32) | b);
      bytes += (groups[g].lens[b] + 1) * E * static_cast<int64_t>(sizeof(raw));
    }
  std::stable_sort(order.begin(), order.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  const int64_t rows_n = static_cast<int64_t>(order.size());
  const int64_t by_work = std::max<int64_t>(1, bytes * std::max<int64_t>(1, Hq / 8) / kGrainBytes);
  const int64_t nt_max = std::min<int64_t>(at::get_num_threads(), by_work);
  int64_t hc = Hq;
  while (hc > 16 && rows_n * ((Hq + hc - 1) / hc) < 2 * nt_max) hc = (hc + 1) / 2;
  const int64_t blocks = (Hq + hc - 1) / hc, items = rows_n * blocks;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nt_max, items)));
  const int64_t rd = E - Dl;
  std::vector<int64_t> t_start(nt, -1), t_end(nt, -1);
  int team = 1;
  const int64_t t0 = now_ns();
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    t_start[tid] = now_ns();
    if (tid == 0) team = omp_get_num_threads();
    if (append) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < rows_n; ++i) {  // X[b, L_b] = [c_new[r], kpe_new[r]]
        const int64_t key = order[i].second;
        const LatGroup<raw>& gr = groups[key >> 32];
        const int64_t b = key & 0xffffffffLL, r = gr.rows[b];
        raw* dst = gr.X + b * gr.c_row + gr.lens[b] * E;
        std::memcpy(dst, c_new + r * c_row, Dl * sizeof(raw));
        std::memcpy(dst + Dl, kpe_new + r * kpe_row, rd * sizeof(raw));
      }  // implicit barrier: every row appended before any item reads one
    }
    LatScratch w{std::vector<float>(hc * E), std::vector<float>(hc * Dl), std::vector<float>(hc),
                 std::vector<float>(hc), std::vector<float>(4 * LT)};
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < items; ++i) {
      const int64_t key = order[i / blocks].second, h0 = (i % blocks) * hc;
      const LatGroup<raw>& gr = groups[key >> 32];
      const int64_t b = key & 0xffffffffLL, nh = std::min(hc, Hq - h0);
      if (E == 576)  // DeepSeek-V2 / V3: kv_lora_rank 512 + rope 64, a compile-time row width
        lat_item<Tr, 576>(gr, b, h0, nh, q, out, E, Dl, append, q_row, out_row, scale, w);
      else
        lat_item<Tr, 0>(gr, b, h0, nh, q, out, E, Dl, append, q_row, out_row, scale, w);
    }
    t_end[tid] = now_ns();
  }
  record_region(t0, now_ns(), team, t_start, t_end);
}

// groups: latents [B_g, S_g, E], rows and lens int64 [B_g]; q [B, Hq, E], c_new [B, Dl], kpe_new [B, rd], out
// [B, Hq, Dl] (rows contiguous; checked by the Python wrapper with the shapes and dtypes). Returns "" or the message
// of a failed index check (check_indices).
std::string latent_attention_append_groups(at::Tensor q, at::Tensor c_new, at::Tensor kpe_new,
                                           std::vector<at::Tensor> rows, std::vector<at::Tensor> X,
                                           std::vector<at::Tensor> lens, at::Tensor out, double scale, bool append) {
  TORCH_CHECK(!X.empty() && X.size() == rows.size() && X.size() == lens.size(),
              "latent_attention_append_groups: one cache, rows and lengths tensor per group");
  const std::string bad = check_indices(rows, X, lens, q.size(0), append, 1);
  if (!bad.empty()) return bad;
  const int64_t Hq = q.size(1), E = X[0].size(2), Dl = out.size(2);
  auto run = [&](auto tr) {
    using Tr = decltype(tr);
    using raw = typename Tr::raw;
    std::vector<LatGroup<raw>> groups;
    for (size_t g = 0; g < X.size(); ++g)
      groups.push_back({static_cast<raw*>(X[g].data_ptr()), rows[g].data_ptr<int64_t>(), lens[g].data_ptr<int64_t>(),
                        X[g].size(0), X[g].stride(0)});
    latent_groups<Tr>(groups, static_cast<const raw*>(q.data_ptr()), static_cast<const raw*>(c_new.data_ptr()),
                      static_cast<const raw*>(kpe_new.data_ptr()), static_cast<raw*>(out.data_ptr()), Hq, E, Dl,
                      append, q.stride(0), c_new.stride(0), kpe_new.stride(0), out.stride(0),
                      static_cast<float>(scale));
  };
  switch (X[0].scalar_type()) {
    case at::kFloat: run(F32()); break;
    case at::kBFloat16: run(BF16()); break;
    case at::kHalf: run(F16()); break;
    default: TORCH_CHECK(false, "latent_attention_append_groups: unsupported dtype ", X[0].scalar_type());
  }
  return "";
}

// scatter_rows: dst[dst_idx[i, h]] = src[tok[i], h] for i < n, h < H, whole rows of w elements (one memcpy each),
// parallel over i (a prefill chunk's k / v rows into the flat KV cache). dst [N, w] and src [T, H, w] with contiguous
// rows, dst_idx int64 [n, H] and tok int64 [n] (empty: tok[i] = i) contiguous (checked by the Python wrapper with the
// shapes and dtypes). Returns "" or the message of an index out of range (one of them, if several: that copy skipped,
// the others written).
std::string scatter_rows(at::Tensor dst, at::Tensor src, at::Tensor dst_idx, at::Tensor tok) {
  const int64_t n = dst_idx.size(0), H = dst_idx.size(1), N = dst.size(0), T = src.size(0), es = dst.element_size();
  const int64_t d0 = dst.stride(0) * es, s0 = src.stride(0) * es, s1 = src.stride(1) * es, row = dst.size(1) * es;
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  const int64_t* di = dst_idx.data_ptr<int64_t>();
  const int64_t* ti = tok.numel() ? tok.data_ptr<int64_t>() : nullptr;
  const int64_t by_work = std::max<int64_t>(1, n * H * row / (256 << 10));  // >= 256 KiB per thread
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), by_work)));
  // chunks of >= 64 KiB taken as threads free up: a thread the OS keeps off its core delays the region less
  const int64_t chunk = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, H * row));
  std::atomic<int64_t> bad{-1};  // 2 i: the source row of i out of range; 2 i + 1: a destination row of i
#pragma omp parallel for num_threads(nt) schedule(dynamic, chunk)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = ti ? ti[i] : i;
    if (t < 0 || t >= T) { bad.store(2 * i); continue; }
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = di[i * H + h];
      if (r < 0 || r >= N) { bad.store(2 * i + 1); continue; }
      std::memcpy(d + r * d0, s + t * s0 + h * s1, row);
    }
  }
  const int64_t b = bad.load(), i = b / 2;
  if (b < 0) return "";
  if (b % 2 == 0) return "index " + std::to_string(i) + " out of range (source row " + std::to_string(ti[i]) + " of " +
                         std::to_string(T) + ")";
  return "index " + std::to_string(i) + " out of range (a destination row not in [0, " + std::to_string(N) + "))";
}

// exp_fast over an fp32 tensor (for its test against torch.exp)
torch::Tensor softmax_exp(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "softmax_exp: a contiguous fp32 tensor");
  auto y = torch::empty_like(x);
  const float* a = x.data_ptr<float>();
  float* b = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) b[i] = exp_fast(a[i]);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("softmax_exp", &softmax_exp);
  m.def("decode_attention_append_groups", &decode_attention_append_groups, py::call_guard<py::gil_scoped_release>());
  m.def("latent_attention_append_groups", &latent_attention_append_groups, py::call_guard<py::gil_scoped_release>());
  m.def("scatter_rows", &scatter_rows, py::call_guard<py::gil_scoped_release>());
  m.def("native_stats", &native_stats);
}
"""

_lock = threading.Lock()
_module = None  # the built extension, False when it cannot be built


def _cpu_tag() -> str:
    """The CPU's model and instruction-set flags: the build uses -march=native, so a cached build must not be
    reused on another kind of CPU (e.g. a home directory shared by different machines)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({l for l in f if l.startswith(("model name", "flags"))}))
    except OSError:
        import platform

        return platform.processor() or platform.machine()


def build_directory() -> tuple[str, str]:
    """(extension name, build directory) of the native kernel for this source, torch install and CPU.

    The name hashes the C++ source, torch's version AND install location (two virtual environments with the same
    torch version would otherwise share one directory and rebuild it back and forth, each build invalidating the
    other's) and the CPU (-march=native). The directory is ``$TORCH_EXTENSIONS_DIR`` (default: torch's
    ``get_default_build_root()``) / lightning_moe / name.
    """
    from torch.utils.cpp_extension import get_default_build_root

    key = _CPP + torch.__version__ + os.path.dirname(os.path.realpath(torch.__file__)) + _cpu_tag()
    name = f"lightning_moe_cpu_attention_{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return name, os.path.join(root, "lightning_moe", name)


def _build():
    """Build (or load the cached build of) the native kernel, one process at a time.

    torch's own build lock is a plain file (``<build dir>/lock``) that a process killed mid-build leaves behind, and
    every later build or load then waits on it forever (found by a user check: a run killed during the first build
    left the next run hung with no message). So the build runs under an advisory ``flock`` of our own, which the OS
    releases when its holder dies; whoever holds it and still finds torch's lock file knows it is stale (every
    builder of this directory takes the flock first) and removes it.
    """
    import fcntl

    from torch.utils.cpp_extension import load_inline

    name, build_dir = build_directory()
    os.makedirs(build_dir, exist_ok=True)
    flags = ["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing", "-fassociative-math", "-fno-signed-zeros",
             "-fno-trapping-math"]  # the last three let the compiler vectorize the fp32 dot-product sums
    with open(os.path.join(build_dir, "lightning_moe.flock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits for a live build; released by the OS if its holder dies
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            log.warning("removing %s, left by a build that did not finish (a killed process)", stale)
            os.remove(stale)
        return load_inline(name=name, cpp_sources=[_CPP], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=build_dir, verbose=False)


def native_loaded() -> bool:
    """Whether this process has already built or loaded the native kernel (or given up on it): a call of
    :func:`native_available` then returns at once."""
    return _module is not None


def native_built() -> bool:
    """Whether a build of the native kernel for this source, torch and CPU is on disk (loading it then takes well
    under a second; without it the first use compiles, ~20-60 s)."""
    name, build_dir = build_directory()
    return os.path.exists(os.path.join(build_dir, f"{name}.so"))


CPU_ATTENTION_MODES = ("auto", "native", "sdpa")  # values of LIGHTNING_MOE_CPU_ATTENTION


def cpu_attention_mode() -> str:
    """``LIGHTNING_MOE_CPU_ATTENTION`` (unset or empty: ``auto``); raises ValueError naming the variable for a value not
    in :data:`CPU_ATTENTION_MODES`."""
    mode = os.environ.get("LIGHTNING_MOE_CPU_ATTENTION", "auto").strip().lower() or "auto"
    if mode not in CPU_ATTENTION_MODES:
        raise ValueError(f"environment variable LIGHTNING_MOE_CPU_ATTENTION={mode!r}: expected one of "
                         f"{', '.join(CPU_ATTENTION_MODES)}")
    return mode


def native_available() -> bool:
    """Whether the native kernel can be used: built (on first call; ~30-60 s once) and not disabled with
    ``LIGHTNING_MOE_CPU_ATTENTION=sdpa`` (``auto``/``native``/unset: use it when it builds). A build failure is
    logged once as a warning and gives False. Raises ValueError for any other value of that variable."""
    global _module
    if cpu_attention_mode() == "sdpa":
        return False
    with _lock:
        if _module is None:
            try:
                _module = _build()
            except Exception as e:  # no compiler, no OpenMP, ...: fall back to PyTorch's routine
                log.warning("native CPU decode attention could not be built (%s: %s); using PyTorch's "
                            "scaled_dot_product_attention instead", type(e).__name__, str(e).splitlines()[0][:300])
                _module = False
    return _module is not False


NATIVE_STATS_KEYS = ("calls", "region_s", "team_thread_s", "busy_thread_s", "lag_s", "tail_s", "threads")


def native_stats(reset: bool = False) -> dict[str, float]:
    """Where the native kernel's time went, summed over its calls since the last reset (process-wide).

    Keys (seconds are wall seconds; thread-seconds are summed over the team's threads):
      calls: parallel regions run (one per call); threads: team threads summed over calls (/ calls = team size);
      region_s: wall time inside the parallel regions; team_thread_s: region time x team size;
      busy_thread_s: each thread's time from its first item to the end of its own items (compute, memory stalls
      and time the OS took the core away while it held an item);
      lag_s: per call, the latest thread's start after the region began (wake-up of threads not on a core);
      tail_s: per call, the time from the first thread running out of items to the region's end.
    ``busy_thread_s / team_thread_s`` is the team's efficiency: near 1 when every thread worked the whole region.
    All zeros while the kernel is not built (this never builds it). ``reset``: zero the sums after reading them.
    """
    if not _module:
        return {k: 0.0 for k in NATIVE_STATS_KEYS}
    return dict(zip(NATIVE_STATS_KEYS, _module.native_stats(reset)))


def softmax_exp(x: torch.Tensor) -> torch.Tensor:
    """The native kernel's softmax exponential (``exp_fast``: x clamped to [-87.3, 88.3], ~1 ulp) of a contiguous
    fp32 CPU tensor; its reference is torch.exp. RuntimeError without the native kernel."""
    if not native_available():
        raise RuntimeError("softmax_exp: the native CPU attention kernel is not available")
    return _module.softmax_exp(x)


def decode_attention_append(q: torch.Tensor, k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor],
                            rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                            out: torch.Tensor, sliding_window: Optional[int] = None,
                            sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Append one decode token's K/V per cache row and attend, writing the output rows in place (native kernel).

    Args:
        q: [B, Hq, hd] queries of the caller's B rows (CPU; rows contiguous).
        k_new, v_new: [B, Hkv, hd] the new token's keys / values of the caller's rows, or both None: nothing is
            appended and each row attends over its ``lengths`` positions.
        rows: int64 [B_g]: caller row of each cache row (0 <= rows < B, distinct).
        k_cache, v_cache: [B_g, Hkv, S, hd] CPU cache of B_g rows (one length group), each head's positions
            contiguous (a cache tensor or a slice ``[:, :, :n]`` of one).
        lengths: int64 [B_g] positions already cached per cache row; the new token goes to position lengths[i]
            (needs lengths < S), and the row attends over lengths + 1 positions (the last ``sliding_window``).
        out: [B, Hq * hd] written at the ``rows`` (other rows untouched), same dtype as q.
        sinks: None, or fp32 [Hq] on the CPU: one sink logit per query head (gpt-oss), counted in each head's softmax
            and dropped from its output.
    Returns ``out``. Dtypes: bf16, fp16 or fp32, the same for q, k_new, v_new, the caches and out; arithmetic
    in fp32. Equals :func:`decode_attention_append_reference` up to summation order (fp32 ~1e-6, bf16 ~1e-2
    relative, one rounding of the output).
    Raises:
        ValueError: shape, dtype, device or contiguity mismatch, a row index out of range or repeated, a length out
        of [0, S) (with append) / [1, S] (without).
        RuntimeError: the native kernel is not available (:func:`native_available` is False).
    """
    return decode_attention_append_groups(q, k_new, v_new, [rows], [k_cache], [v_cache], [lengths], out, sliding_window,
                                          sinks=sinks, fn="decode_attention_append")


def check_operands(fn: str, tensors: list, dtype: torch.dtype, names: str) -> None:
    """The per-call tensors ``[(name, t)]`` of a native CPU attention call: on the CPU, of the cache's ``dtype``
    (bf16 / fp16 / fp32), each row contiguous; ``names`` lists them for the dtype message. Raises ValueError."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{fn}: cache dtype {dtype}; one of bf16 / fp16 / fp32 is needed")
    for name, t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"{fn}: {name} must be on the CPU, got {t.device}")
        if t.dtype != dtype:
            raise ValueError(f"{fn}: {name} dtype {t.dtype}; all of {names}, caches, out must share one of "
                             f"bf16 / fp16 / fp32 (cache: {dtype})")
        if t.shape[0] and not t[0].is_contiguous():  # each row contiguous (rows may be strided)
            raise ValueError(f"{fn}: {name} rows must be contiguous, got strides {t.stride()}")


def decode_attention_append_groups(q: torch.Tensor, k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor],
                                   rows: Sequence[torch.Tensor], k_caches: Sequence[torch.Tensor],
                                   v_caches: Sequence[torch.Tensor], lengths: Sequence[torch.Tensor], out: torch.Tensor,
                                   sliding_window: Optional[int] = None, sinks: Optional[torch.Tensor] = None,
                                   fn: str = "decode_attention_append_groups") -> torch.Tensor:
    """:func:`decode_attention_append` over several cache groups (the length groups of a grouped KV cache) in ONE
    native call: one parallel region over every (group, cache row, KV head) item, longest rows first, instead of
    one call per group. ``rows[g]``, ``k_caches[g]``, ``v_caches[g]``, ``lengths[g]`` are group g's arguments of
    :func:`decode_attention_append` (``sinks`` as there) (caches ``[B_g, Hkv, S_g, hd]``: the same Hkv, hd and dtype in every group);
    the rows of all groups are distinct. Returns ``out``; the same results as one call per group, bit for bit.
    Raises ValueError (as :func:`decode_attention_append`, naming the group) or RuntimeError without the kernel.
    """
    if not native_available():
        raise RuntimeError(f"{fn}: the native CPU attention kernel is not available (see native_available())")
    if not (len(rows) == len(k_caches) == len(v_caches) == len(lengths)) or not k_caches:
        raise ValueError(f"{fn}: need one rows / k_cache / v_cache / lengths per group, got {len(rows)} / "
                         f"{len(k_caches)} / {len(v_caches)} / {len(lengths)}")
    if q.dim() != 3:
        raise ValueError(f"{fn}: need q [B, Hq, hd], got q {tuple(q.shape)}")
    B, Hq = q.shape[0], q.shape[1]
    append = k_new is not None
    if append != (v_new is not None):
        raise ValueError(f"{fn}: give both k_new and v_new or neither")
    if k_caches[0].dim() != 4:
        raise ValueError(f"{fn}: caches must be [B_g, Hkv, S, hd], got k {tuple(k_caches[0].shape)}")
    Hkv, hd, dtype = k_caches[0].shape[1], k_caches[0].shape[3], k_caches[0].dtype
    # the tensors every group shares: checked once per call (this runs once per CPU micro-batch and layer)
    if q.shape[2] != hd or Hq % Hkv:
        raise ValueError(f"{fn}: q {tuple(q.shape)} does not fit caches with {Hkv} KV heads of dim {hd}")
    if append and (k_new.shape != (B, Hkv, hd) or v_new.shape != (B, Hkv, hd)):
        raise ValueError(f"{fn}: k_new / v_new must be [B, Hkv, hd] = {(B, Hkv, hd)}, got {tuple(k_new.shape)} / "
                         f"{tuple(v_new.shape)}")
    if out.shape != (B, Hq * hd):
        raise ValueError(f"{fn}: out must be [B, Hq*hd] = {(B, Hq * hd)}, got {tuple(out.shape)}")
    check_operands(fn, [("q", q), ("out", out)] + ([("k_new", k_new), ("v_new", v_new)] if append else []), dtype,
                   "q, k_new, v_new")
    cleaned = []
    for g, (r, kc, vc, n) in enumerate(zip(rows, k_caches, v_caches, lengths)):
        where = f" (group {g})" if len(k_caches) > 1 else ""
        if kc.dim() != 4 or vc.shape != kc.shape or kc.shape[1] != Hkv or kc.shape[3] != hd:
            raise ValueError(f"{fn}{where}: need q [B, Hq, hd] and caches [B_g, Hkv, S, hd] of one shape (Hkv, hd as in "
                             f"group 0), got q {tuple(q.shape)}, k {tuple(kc.shape)}, v {tuple(vc.shape)}")
        Bg = kc.shape[0]
        for name, t in (("k_cache", kc), ("v_cache", vc)):
            if t.dtype != dtype:
                raise ValueError(f"{fn}{where}: {name} dtype {t.dtype}; all of q, k_new, v_new, caches, out must share "
                                 f"one of bf16 / fp16 / fp32 (cache: {dtype})")
            if t.device.type != "cpu":
                raise ValueError(f"{fn}{where}: {name} must be on the CPU, got {t.device}")
        if kc.stride() != vc.stride() or kc.stride(3) != 1 or kc.stride(2) != hd:
            raise ValueError(f"{fn}{where}: each head's positions must be contiguous rows of hd elements, with the same "
                             f"strides for K and V (e.g. the caches or slices [:, :, :n] of them), got {kc.stride()} / "
                             f"{vc.stride()}")
        if r.dtype != torch.int64 or n.dtype != torch.int64 or r.shape != (Bg,) or n.shape != (Bg,):
            raise ValueError(f"{fn}{where}: rows and lengths must be int64 [B_g] = [{Bg}], got {r.dtype} "
                             f"{tuple(r.shape)}, {n.dtype} {tuple(n.shape)}")
        if r.device.type != "cpu" or n.device.type != "cpu":
            raise ValueError(f"{fn}{where}: rows and lengths must be on the CPU, got {r.device} / {n.device}")
        cleaned.append((r.contiguous(), kc, vc, n.contiguous()))
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (Hq,) or sinks.device.type != "cpu"
                              or not sinks.is_contiguous()):
        raise ValueError(f"{fn}: sinks must be a contiguous fp32 CPU tensor [Hq] = [{Hq}], got {sinks.dtype} "
                         f"{tuple(sinks.shape)} on {sinks.device}")
    sk = sinks if sinks is not None else torch.empty(0, dtype=torch.float32)
    window = int(sliding_window) if sliding_window else -1
    kn = k_new if append else q.new_empty((0, Hkv, hd))
    vn = v_new if append else q.new_empty((0, Hkv, hd))
    # the index values (rows in range and distinct, lengths within each cache) are checked by the native call
    # before it writes anything; it returns the message of a failed check
    bad = _module.decode_attention_append_groups(q, kn, vn, [c[0] for c in cleaned], [c[1] for c in cleaned],
                                                 [c[2] for c in cleaned], [c[3] for c in cleaned], out, window, append, sk)
    if bad:
        raise ValueError(f"{fn}{bad}")
    return out


def decode_mask(lengths: torch.Tensor, S: int, sliding_window: Optional[int] = None) -> torch.Tensor:
    """bool [B, 1, 1, S] on ``lengths``' device: True at the key positions a row must not see (at or past its length
    ``lengths`` int64 [B], or outside the sliding window): :func:`decode_attention_torch`'s mask, which a caller that
    attends many layers over the same lengths makes once (:func:`decode_attention_torch_masked`)."""
    pos = torch.arange(S, device=lengths.device)  # [S]
    valid = pos[None, :] < lengths[:, None]  # [B, S]
    if sliding_window is not None:
        valid &= pos[None, :] >= (lengths[:, None] - sliding_window)
    return ~valid[:, None, None, :]


def decode_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, sliding_window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Ragged GQA decode attention: one new query per sequence over its cached keys/values.

    q: [B, Hq, hd]; k_cache, v_cache: [B, Hkv, S, hd] (S >= max(lengths); the new token's k/v already
    written); lengths: int64 [B], the number of valid positions of each row (pad keys beyond a row's
    length are masked, as are keys outside the sliding window). Softmax in fp32; ``sinks`` (None or [Hq]): one
    extra logit per query head in the softmax, its share dropped (gpt-oss's attention sinks).
    Returns [B, Hq*hd] in q's dtype. Equal, bit for bit, to :func:`decode_attention_torch_masked` with
    :func:`decode_mask` (which it calls).
    """
    lengths = lengths.to(q.device, non_blocking=True)  # host lengths: no stream sync (pageable H2D is staged)
    return decode_attention_torch_masked(q, k_cache, v_cache, decode_mask(lengths, k_cache.shape[2], sliding_window),
                                         sinks)


def decode_attention_torch_masked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, masked: torch.Tensor,
                                  sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`decode_attention_torch` with its mask given: ``masked`` bool [B, 1, 1, S] on q's device
    (:func:`decode_mask` of the lengths and window). q: [B, Hq, hd]; k_cache, v_cache: [B, Hkv, S, hd]; ``sinks``
    None or [Hq]. Returns [B, Hq*hd] in q's dtype."""
    B, Hq, hd = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    qg = q.view(B, Hkv, G, hd)  # [B, Hkv, G, hd]
    scores = torch.matmul(qg, k_cache.transpose(2, 3)) / math.sqrt(hd)  # [B, Hkv, G, S]
    scores = scores.masked_fill(masked, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [B, Hkv, G, S]
    else:
        sk = sinks.float().view(1, Hkv, G, 1).expand(B, Hkv, G, 1)  # [B, Hkv, G, 1]
        probs = torch.softmax(torch.cat([scores.float(), sk], dim=-1), dim=-1)[..., :-1].to(q.dtype)  # [B, Hkv, G, S]
    out = torch.matmul(probs, v_cache)  # [B, Hkv, G, hd]
    return out.reshape(B, Hq * hd)


def decode_attention_append_reference(q: torch.Tensor, k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor],
                                      rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                      lengths: torch.Tensor, out: torch.Tensor,
                                      sliding_window: Optional[int] = None,
                                      sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pure-torch reference of :func:`decode_attention_append` (same arguments and effects): the K/V rows are
    written by indexing and the attention is :func:`decode_attention_torch` (scores in the storage dtype, softmax in
    fp32), on the group's rows gathered from q."""

    n = lengths.clone()
    if k_new is not None:
        slots = torch.arange(rows.shape[0])
        k_cache[slots, :, lengths] = k_new[rows]
        v_cache[slots, :, lengths] = v_new[rows]
        n += 1
    S = int(n.max()) if n.numel() else 0
    if rows.numel():
        out[rows] = decode_attention_torch(q[rows], k_cache[:, :, :S], v_cache[:, :, :S], n, sliding_window,
                                           sinks).to(out.dtype)
    return out


def _check_scatter(fn: str, dst: torch.Tensor, src: torch.Tensor, dst_idx: torch.Tensor,
                   tok: Optional[torch.Tensor]) -> None:
    """The operands of :func:`scatter_rows` / :func:`scatter_rows_torch`: shapes, dtypes, devices. Raises ValueError."""
    if dst.dim() != 2 or src.dim() != 3 or dst_idx.dim() != 2 or (tok is not None and tok.dim() != 1):
        raise ValueError(f"{fn}: dst [N, w], src [T, H, w], dst_idx [n, H], tok [n] expected, got {tuple(dst.shape)}, "
                         f"{tuple(src.shape)}, {tuple(dst_idx.shape)}, {None if tok is None else tuple(tok.shape)}")
    n, H = dst_idx.shape
    if src.shape[1:] != (H, dst.shape[1]) or (tok is not None and tok.shape[0] != n) or (tok is None and n > src.shape[0]):
        raise ValueError(f"{fn}: src {tuple(src.shape)} does not match dst {tuple(dst.shape)}, dst_idx "
                         f"{tuple(dst_idx.shape)}, tok {None if tok is None else tuple(tok.shape)}")
    if src.dtype != dst.dtype or dst_idx.dtype != torch.int64 or (tok is not None and tok.dtype != torch.int64):
        raise ValueError(f"{fn}: src {src.dtype} must be dst's {dst.dtype}, indexes int64")
    if src.device != dst.device or dst_idx.device != dst.device or (tok is not None and tok.device != src.device):
        raise ValueError(f"{fn}: dst, src and the indexes must be on one device")


def scatter_rows(dst: torch.Tensor, src: torch.Tensor, dst_idx: torch.Tensor, tok: Optional[torch.Tensor] = None) -> None:
    """``dst[dst_idx[i, h]] = src[tok[i], h]`` for every i < n, h < H: whole rows, one memcpy each, parallel over i
    (OpenMP, torch's thread count; native kernel). A prefill chunk's k / v rows into a flat CPU KV cache at memory
    bandwidth (torch's index_put copies element by element: ~2.5x slower on 2 cores at hd 128).

    Args:
        dst: [N, w] CPU tensor (each row contiguous; rows may be strided, e.g. columns of a wider array).
        src: [T, H, w] CPU tensor of dst's dtype (each [w] row contiguous).
        dst_idx: int64 [n, H] destination row of each (i, h), 0 <= dst_idx < N.
        tok: int64 [n] source row of each i (0 <= tok < T), or None: tok[i] = i (n <= T).
    Rows must not overlap between (i, h) pairs (the copies run in parallel; equal destinations race).
    Raises ValueError on mismatched operands or an index out of range (the other rows are written),
    RuntimeError if the native kernel is not available. Equals :func:`scatter_rows_torch` for valid indexes (which
    does not check them).
    """
    _check_scatter("scatter_rows", dst, src, dst_idx, tok)
    if dst.device.type != "cpu" or dst.stride(1) != 1 or src.stride(2) != 1:
        raise ValueError(f"scatter_rows: CPU tensors with contiguous rows needed, got {dst.device}, dst strides "
                         f"{dst.stride()}, src strides {src.stride()}")
    if not native_available():
        raise RuntimeError("scatter_rows: the native CPU attention kernel is not available (see native_available())")
    empty = torch.empty(0, dtype=torch.int64)
    bad = _module.scatter_rows(dst, src, dst_idx.contiguous(), empty if tok is None else tok.contiguous())
    if bad:
        raise ValueError(f"scatter_rows: {bad}")


def scatter_rows_torch(dst: torch.Tensor, src: torch.Tensor, dst_idx: torch.Tensor,
                       tok: Optional[torch.Tensor] = None) -> None:
    """:func:`scatter_rows` in torch ops on any device (the reference, and the path of GPU caches): one index_put of
    whole rows, viewed as int64 when a row's bytes allow it (8-byte elements: ~2x faster on the CPU than bf16's).
    Equal to it for valid, distinct indexes; it does not check them (a negative index wraps around, one past the end
    raises torch's IndexError, on CUDA a device-side assert): its callers pass ``GroupedKVCache.prefill_index``'s."""
    _check_scatter("scatter_rows_torch", dst, src, dst_idx, tok)
    src = src[:dst_idx.shape[0]] if tok is None else src.index_select(0, tok)  # [n, H, w]
    if dst.shape[1] * dst.element_size() % 8 == 0 and dst.dtype != torch.int64:
        try:  # needs 8-byte aligned strides and offset (a column view of a row may not have them)
            dst, src = dst.view(torch.int64), src.contiguous().view(torch.int64)
        except RuntimeError:
            pass
    dst[dst_idx] = src
