// CPU kernels for the decode step, called from XLA through its FFI (see cpu_kernels/__init__.py).
//
// XLA:CPU multiplies a batch-1 activation by bfloat16 weights at ~1.5 GB/s and gathers paged
// K/V at ~5 GB/s (BENCHMARKS.md, issue 22); these loops stream both at the memory's rate.
//
//   sj_packed_matmul_{f32,bf16}  y[M, P*NB] = x[M, K] @ W, W packed as [P, K, NB] panels
//                                (each panel's NB output columns contiguous along K), float32
//                                accumulation.
//   sj_decode_attention_{f32,bf16}_{dense,sparse}
//                                one query token per slot against a paged cache
//                                [KV, pages, S, D]: all of a slot's pages (dense) or the
//                                selected logical pages of each kv head (sparse); online
//                                softmax in float32 over chunks of pages, chunks merged.
//
// Work is split over XLA's intra-op thread pool (FFI ThreadPool); the calling thread takes
// work items too, so the call finishes even if the pool never runs a scheduled task.
// Built at first use with the machine's C++ compiler (-O3 -march=native).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kNB = 64;  // output columns per packed panel (4 x 16 floats)
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline v16 load16(const uint16_t* p) {  // 16 bfloat16 -> float32
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 r;
  std::memcpy(&r, &w, sizeof(r));
  return r;
}
inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Runs fn(i) for i in [0, n) on the pool and the calling thread; returns when all are done.
void parallel_for(ffi::ThreadPool& pool, int64_t n, const std::function<void(int64_t)>& fn) {
  int64_t threads = std::min<int64_t>(n, std::max<int64_t>(1, pool.num_threads()));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::function<void(int64_t)> fn;
    int64_t n;
  };
  auto st = std::make_shared<State>();
  st->fn = fn;
  st->n = n;
  auto work = [st]() {
    int64_t i;
    while ((i = st->next.fetch_add(1, std::memory_order_relaxed)) < st->n) {
      st->fn(i);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) {
    auto w = work;
    pool.Schedule(std::move(w));
  }
  work();
  while (st->done.load(std::memory_order_acquire) < n) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

// ---- packed matmul -----------------------------------------------------------------------

// Rows [m0, m0 + MT) of one panel: acc[MT][4] vectors stay in registers.
template <typename W, int MT>
inline void panel_rows(const float* x, const W* panel, float* y, int64_t K, int64_t ldy,
                       int64_t m0, int64_t col0) {
  v16 acc[MT][4];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = v16{} ;
  for (int64_t k = 0; k < K; ++k) {
    const W* wr = panel + k * kNB;
    v16 w0 = load16(wr), w1 = load16(wr + 16), w2 = load16(wr + 32), w3 = load16(wr + 48);
    for (int m = 0; m < MT; ++m) {
      float xv = x[(m0 + m) * K + k];
      acc[m][0] += xv * w0;
      acc[m][1] += xv * w1;
      acc[m][2] += xv * w2;
      acc[m][3] += xv * w3;
    }
  }
  for (int m = 0; m < MT; ++m)
    std::memcpy(y + (m0 + m) * ldy + col0, acc[m], sizeof(acc[m]));
}

template <typename W>
ffi::Error packed_matmul(ffi::ThreadPool pool, const float* x, const W* w, float* y, int64_t M,
                         int64_t K, int64_t P) {
  const int64_t ldy = P * kNB;
  constexpr int64_t kMT = 4;
  const int64_t mtiles = (M + kMT - 1) / kMT;
  // One item = one panel x a group of row tiles; a panel's K x NB slab is read from memory
  // once per item and from cache for the item's further row tiles.
  const int64_t tiles_per_item = std::max<int64_t>(1, std::min<int64_t>(mtiles, 4));
  const int64_t groups = (mtiles + tiles_per_item - 1) / tiles_per_item;
  parallel_for(pool, P * groups, [&](int64_t item) {
    int64_t p = item / groups, g = item % groups;
    const W* panel = w + p * K * kNB;
    int64_t t_end = std::min(mtiles, (g + 1) * tiles_per_item);
    for (int64_t t = g * tiles_per_item; t < t_end; ++t) {
      int64_t m0 = t * kMT, rows = std::min<int64_t>(kMT, M - m0);
      switch (rows) {
        case 4: panel_rows<W, 4>(x, panel, y, K, ldy, m0, p * kNB); break;
        case 3: panel_rows<W, 3>(x, panel, y, K, ldy, m0, p * kNB); break;
        case 2: panel_rows<W, 2>(x, panel, y, K, ldy, m0, p * kNB); break;
        default: panel_rows<W, 1>(x, panel, y, K, ldy, m0, p * kNB); break;
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error PackedMatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kNB || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("sj_packed_matmul: expected x [M, K], w [P, K, 64]");
  return packed_matmul<float>(pool, x.typed_data(), w.typed_data(), y->typed_data(), xd[0],
                              xd[1], wd[0]);
}

ffi::Error PackedMatmulBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kNB || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("sj_packed_matmul: expected x [M, K], w [P, K, 64]");
  return packed_matmul<uint16_t>(pool, x.typed_data(),
                                 reinterpret_cast<const uint16_t*>(w.typed_data()),
                                 y->typed_data(), xd[0], xd[1], wd[0]);
}

// exp of 16 floats: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial (relative
// error ~2e-7); inputs below -87 (masked scores) give ~0.
inline v16 exp16(v16 x) {
  const v16 lo = v16{} - 87.0f, hi = v16{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  v16 n = x * 1.44269504088896341f;
  // round to nearest
  typedef int32_t i32x16 __attribute__((vector_size(64)));
  i32x16 ni = __builtin_convertvector(n + (n >= 0 ? v16{} + 0.5f : v16{} - 0.5f), i32x16);
  v16 nf = __builtin_convertvector(ni, v16);
  v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  i32x16 bits;
  std::memcpy(&bits, &p, sizeof(p));
  bits += ni << 23;
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
inline float hmax(v16 a) {
  v8 lo = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
  v8 hi = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  v8 m8 = lo > hi ? lo : hi;
  v4 l4 = __builtin_shufflevector(m8, m8, 0, 1, 2, 3), h4 = __builtin_shufflevector(m8, m8, 4, 5, 6, 7);
  v4 m4 = l4 > h4 ? l4 : h4;
  return std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3]));
}
inline float hsum(v16 a) {
  v8 s8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[1]) + (s4[2] + s4[3]);
}

// ---- paged decode attention ----------------------------------------------------------------

// One query head's online-softmax update with one page (`valid` of its S tokens): m, l and
// acc [D] of the head. Any S and D, scalar loops.
template <typename C>
inline void page_update(const float* qg, const C* kpage, const C* vpage, int64_t valid,
                        int64_t D, float scale, float& m, float& l, float* acc,
                        float* scores /* [S] */) {
  float mx = m;
  for (int64_t t = 0; t < valid; ++t) {
    const C* kt = kpage + t * D;
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += qg[d] * to_f32(kt[d]);
    scores[t] = s * scale;
    mx = std::max(mx, scores[t]);
  }
  const float corr = std::exp(m - mx);  // exp(-inf) = 0 on the first page
  float sum = l * corr;
  for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
  for (int64_t t = 0; t < valid; ++t) {
    const float p = std::exp(scores[t] - mx);
    sum += p;
    const C* vt = vpage + t * D;
    for (int64_t d = 0; d < D; ++d) acc[d] += p * to_f32(vt[d]);
  }
  m = mx;
  l = sum;
}

// The same for pages of 16 tokens and D a multiple of 16: the page's 16 scores are one vector
// (one exp16), the value rows are added with vector FMAs.
template <typename C>
inline void page_update16(const float* qg, const C* kpage, const C* vpage, int64_t valid,
                          int64_t D, float scale, float& m, float& l, float* acc) {
  const int64_t DV = D / 16;
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  float sarr[16];
  for (int64_t t = 0; t < 16; ++t) {
    const C* kt = kpage + t * D;
    v16 part = load16(qg) * load16(kt);
    for (int64_t c = 1; c < DV; ++c) part += load16(qg + c * 16) * load16(kt + c * 16);
    sarr[t] = hsum(part);
  }
  v16 sc = load16(sarr) * scale;
  if (valid < 16) sc = lane >= float(valid) ? v16{} - INFINITY : sc;
  const float mx = std::max(m, hmax(sc));
  const float corr = std::exp(m - mx);
  const v16 p = exp16(sc - mx);
  l = l * corr + hsum(p);
  m = mx;
  for (int64_t c = 0; c < DV; ++c) {
    v16 a = load16(acc + c * 16) * corr;
    for (int64_t t = 0; t < valid; ++t) a += p[t] * load16(vpage + t * D + c * 16);
    std::memcpy(acc + c * 16, &a, sizeof(a));
  }
}

// The G query heads of one kv head over a chunk of pages: m_out, l_out [G], acc_out [G, D].
template <typename C>
void attend_chunk(const float* q, const C* kp, const C* vp, const int32_t* pages_phys,
                  const int32_t* pages_logical, int64_t npages, int64_t length, int64_t G,
                  int64_t S, int64_t D, float scale, float* m_out, float* l_out,
                  float* acc_out) {
  const bool vec16 = S == 16 && D % 16 == 0;
  std::vector<float> scores(vec16 ? 0 : S);
  for (int64_t g = 0; g < G; ++g) {
    m_out[g] = -INFINITY;
    l_out[g] = 0.f;
    std::fill(acc_out + g * D, acc_out + (g + 1) * D, 0.f);
  }
  for (int64_t j = 0; j < npages; ++j) {
    const int64_t valid = std::min<int64_t>(S, length - int64_t(pages_logical[j]) * S);
    if (valid <= 0) continue;
    const C* kpage = kp + int64_t(pages_phys[j]) * S * D;
    const C* vpage = vp + int64_t(pages_phys[j]) * S * D;
    for (int64_t g = 0; g < G; ++g) {
      if (vec16)
        page_update16<C>(q + g * D, kpage, vpage, valid, D, scale, m_out[g], l_out[g],
                         acc_out + g * D);
      else
        page_update<C>(q + g * D, kpage, vpage, valid, D, scale, m_out[g], l_out[g],
                       acc_out + g * D, scores.data());
    }
  }
}

// q [B, H, D] f32; k, v [KV, P, S, D]; page_table [B, M]; lengths [B];
// page_idx / valid [B, KV, N] (sparse) or null (dense: logical pages 0 .. ceil(len / S) - 1).
template <typename C>
ffi::Error decode_attention(ffi::ThreadPool pool, const float* q, const C* k, const C* v,
                            const int32_t* page_table, const int32_t* lengths,
                            const int32_t* page_idx, const int32_t* valid, float* out,
                            int64_t B, int64_t H, int64_t D, int64_t KV, int64_t P, int64_t S,
                            int64_t M, int64_t N, float scale) {
  if (H % KV != 0) return ffi::Error::InvalidArgument("query heads not a multiple of kv heads");
  const int64_t G = H / KV;
  // Each (slot, kv head) gets its logical page list; lists are cut into chunks so that there
  // are a few work items per thread even at batch 1.
  std::vector<int32_t> logical(B * KV * std::max<int64_t>(M, N));
  std::vector<int32_t> phys(logical.size());
  std::vector<int64_t> count(B * KV);
  const int64_t width = std::max<int64_t>(M, N);
  int64_t max_count = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lengths[b];
    for (int64_t h = 0; h < KV; ++h) {
      int64_t c = 0;
      int32_t* lg = logical.data() + (b * KV + h) * width;
      int32_t* ph = phys.data() + (b * KV + h) * width;
      if (page_idx == nullptr) {
        const int64_t n = std::min<int64_t>(M, (len + S - 1) / S);
        for (int64_t j = 0; j < n; ++j) lg[c++] = int32_t(j);
      } else {
        for (int64_t j = 0; j < N; ++j) {
          const int64_t e = (b * KV + h) * N + j;
          const int32_t lp = page_idx[e];
          if (valid[e] && lp >= 0 && lp < M && int64_t(lp) * S < len) lg[c++] = lp;
        }
      }
      for (int64_t j = 0; j < c; ++j) {
        int32_t pp = page_table[b * M + lg[j]];
        ph[j] = (pp >= 0 && pp < P) ? pp : 0;
      }
      count[b * KV + h] = c;
      max_count = std::max(max_count, c);
    }
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t want_chunks = std::max<int64_t>(1, (4 * threads + B * KV - 1) / (B * KV));
  const int64_t chunk_pages = std::max<int64_t>(
      4, (max_count + want_chunks - 1) / std::max<int64_t>(1, want_chunks));
  const int64_t chunks = std::max<int64_t>(1, (max_count + chunk_pages - 1) / chunk_pages);
  std::vector<float> pm(B * KV * chunks * G), pl(pm.size()), pacc(pm.size() * D);
  parallel_for(pool, B * KV * chunks, [&](int64_t item) {
    const int64_t bh = item / chunks, c = item % chunks;
    const int64_t b = bh / KV, h = bh % KV;
    const int64_t j0 = c * chunk_pages;
    const int64_t n = std::max<int64_t>(0, std::min(count[bh], j0 + chunk_pages) - j0);
    attend_chunk<C>(q + (b * H + h * G) * D, k + h * P * S * D, v + h * P * S * D,
                    phys.data() + bh * width + j0, logical.data() + bh * width + j0, n,
                    lengths[b], G, S, D, scale, pm.data() + item * G, pl.data() + item * G,
                    pacc.data() + item * G * D);
  });
  // Merge the chunks of each (slot, kv head, query head).
  for (int64_t bh = 0; bh < B * KV; ++bh) {
    const int64_t b = bh / KV, h = bh % KV;
    for (int64_t g = 0; g < G; ++g) {
      float mx = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, pm[(bh * chunks + c) * G + g]);
      float* o = out + (b * H + h * G + g) * D;
      std::fill(o, o + D, 0.f);
      if (mx == -INFINITY) continue;  // no valid token: output 0
      float l = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t e = (bh * chunks + c) * G + g;
        if (pm[e] == -INFINITY) continue;
        const float w = std::exp(pm[e] - mx);
        l += pl[e] * w;
        const float* a = pacc.data() + e * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      const float inv = 1.f / l;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
  return ffi::Error::Success();
}

template <ffi::DataType T, typename C>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<T> k,
                           ffi::Buffer<T> v, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> page_idx,
                           ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::F32> out,
                           float scale, bool sparse) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto td = page_table.dimensions();
  auto id = page_idx.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || id.size() != 3 || kd[3] != qd[2])
    return ffi::Error::InvalidArgument(
        "sj_decode_attention: expected q [B, H, D], k/v [KV, P, S, D], page_table [B, M], "
        "page_idx [B, KV, N]");
  return decode_attention<C>(
      pool, q.typed_data(), reinterpret_cast<const C*>(k.typed_data()),
      reinterpret_cast<const C*>(v.typed_data()), page_table.typed_data(),
      lengths.typed_data(), sparse ? page_idx.typed_data() : nullptr,
      sparse ? valid.typed_data() : nullptr, out->typed_data(), qd[0], qd[1], qd[2], kd[0],
      kd[1], kd[2], td[1], id[2], scale);
}


// ---- causal prefill attention ---------------------------------------------------------------

constexpr int kKB = 64;  // keys per block (4 vectors)
constexpr int kQR = 4;   // query rows per tile

// Rows [r0, r0 + kQR) of one query head (rows >= T are not written). qh: the head's rows,
// row stride ldq; kt: the kv head's keys transposed [D, Tp] (Tp = T padded to kKB); vh: its
// values, row stride ldv; out row stride ldo.
void causal_tile(const float* qh, int64_t ldq, const float* kt, int64_t Tp, const float* vh,
                 int64_t ldv, float* oh, int64_t ldo, int64_t r0, int64_t T, int64_t len,
                 int64_t D, float scale, float* acc /* [kQR, D] */) {
  const int64_t rows = std::min<int64_t>(kQR, T - r0);
  float m[kQR], l[kQR];
  for (int r = 0; r < kQR; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
  std::fill(acc, acc + kQR * D, 0.f);
  const int64_t last = std::min(r0 + rows - 1, len - 1);  // the tile's last query with keys
  for (int64_t j0 = 0; j0 <= last; j0 += kKB) {
    v16 s[kQR][4];
    for (int r = 0; r < kQR; ++r)
      for (int c = 0; c < 4; ++c) s[r][c] = v16{};
    for (int64_t d = 0; d < D; ++d) {
      const float* kr = kt + d * Tp + j0;
      v16 k0 = load16(kr), k1 = load16(kr + 16), k2 = load16(kr + 32), k3 = load16(kr + 48);
      for (int r = 0; r < kQR; ++r) {
        const float qv = r < rows ? qh[(r0 + r) * ldq + d] : 0.f;
        s[r][0] += qv * k0;
        s[r][1] += qv * k1;
        s[r][2] += qv * k2;
        s[r][3] += qv * k3;
      }
    }
    const int64_t nkeys = std::min<int64_t>(kKB, last + 1 - j0);
    float p[kQR][kKB];
    for (int r = 0; r < rows; ++r) {
      const int64_t i = r0 + r;
      if (i >= len) continue;
      const int64_t lim = std::min<int64_t>(i, len - 1) - j0;  // keys j0 .. j0 + lim visible
      v16 blk[4];
      const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      const v16 ninf = v16{} - INFINITY;
      for (int c = 0; c < 4; ++c) {
        v16 sc = s[r][c] * scale;
        if (lim < (c + 1) * 16 - 1) sc = (lane + float(c * 16)) > float(lim) ? ninf : sc;
        blk[c] = sc;
      }
      const float mx = std::max(m[r], std::max(std::max(hmax(blk[0]), hmax(blk[1])),
                                               std::max(hmax(blk[2]), hmax(blk[3]))));
      const float corr = std::exp(m[r] - mx);
      float tot = 0.f;
      for (int c = 0; c < 4; ++c) {
        v16 e = exp16(blk[c] - mx);
        std::memcpy(p[r] + c * 16, &e, sizeof(e));
        tot += hsum(e);
      }
      l[r] = l[r] * corr + tot;
      m[r] = mx;
      float* a = acc + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
    }
    // acc[r] += p[r] @ V[j0 : j0 + nkeys], 64 value columns at a time
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      v16 o[kQR][4];
      for (int r = 0; r < kQR; ++r)
        for (int c = 0; c < 4; ++c) o[r][c] = load16(acc + r * D + d0 + c * 16);
      for (int64_t j = 0; j < nkeys; ++j) {
        const float* vr = vh + (j0 + j) * ldv + d0;
        v16 v0 = load16(vr), v1 = load16(vr + 16), v2 = load16(vr + 32), v3 = load16(vr + 48);
        for (int r = 0; r < kQR; ++r) {
          const float pv = (r < rows && r0 + r < len) ? p[r][j] : 0.f;
          o[r][0] += pv * v0;
          o[r][1] += pv * v1;
          o[r][2] += pv * v2;
          o[r][3] += pv * v3;
        }
      }
      for (int r = 0; r < kQR; ++r)
        for (int c = 0; c < 4; ++c) std::memcpy(acc + r * D + d0 + c * 16, &o[r][c], 64);
    }
  }
  for (int r = 0; r < rows; ++r) {
    float* orow = oh + (r0 + r) * ldo;
    if (r0 + r >= len || l[r] == 0.f) {
      std::fill(orow, orow + D, 0.f);
      continue;
    }
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) orow[d] = acc[r * D + d] * inv;
  }
}

// q [B, T, H, D], k / v [B, T, KV, D] float32, lengths [B] -> out [B, T, H, D]; D % 64 == 0.
ffi::Error CausalAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out,
                           float scale) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || kd[0] != qd[0] || kd[1] != qd[1] ||
      kd[3] != qd[3] || qd[2] % kd[2] != 0 || qd[3] % 64 != 0)
    return ffi::Error::InvalidArgument(
        "sj_causal_attention: expected q [B, T, H, D], k/v [B, T, KV, D], D % 64 == 0");
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3], KV = kd[2], G = H / KV;
  const int64_t Tp = (T + kKB - 1) / kKB * kKB;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* lp = lengths.typed_data();
  float* op = out->typed_data();
  // Keys transposed per (row, kv head): [B, KV, D, Tp], zero past T.
  std::vector<float> kt(B * KV * D * Tp, 0.f);
  parallel_for(pool, B * KV, [&](int64_t bh) {
    const int64_t b = bh / KV, h = bh % KV;
    float* dst = kt.data() + bh * D * Tp;
    for (int64_t t = 0; t < T; ++t) {
      const float* src = kp + ((b * T + t) * KV + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d * Tp + t] = src[d];
    }
  });
  // Items: (row, query head, tile of kQR queries), the longest (last) tiles first.
  const int64_t tiles = (T + kQR - 1) / kQR;
  parallel_for(pool, B * H * tiles, [&](int64_t item) {
    const int64_t tile = tiles - 1 - item / (B * H);
    const int64_t bh = item % (B * H);
    const int64_t b = bh / H, h = bh % H, kvh = h / G;
    const int64_t len = std::min<int64_t>(T, std::max<int32_t>(0, lp[b]));
    std::vector<float> acc(kQR * D);
    causal_tile(qp + (b * T * H + h) * D, H * D, kt.data() + (b * KV + kvh) * D * Tp, Tp,
                vp + (b * T * KV + kvh) * D, KV * D, op + (b * T * H + h) * D, H * D,
                tile * kQR, T, len, D, scale, acc.data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(sj_packed_matmul_f32, PackedMatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(sj_packed_matmul_bf16, PackedMatmulBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#define SJ_DECODE_HANDLER(name, T, C)                                                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (DecodeAttention<T, C>),                       \
                                ffi::Ffi::Bind()                                      \
                                    .Ctx<ffi::ThreadPool>()                           \
                                    .Arg<ffi::Buffer<ffi::F32>>()                     \
                                    .Arg<ffi::Buffer<T>>()                            \
                                    .Arg<ffi::Buffer<T>>()                            \
                                    .Arg<ffi::Buffer<ffi::S32>>()                     \
                                    .Arg<ffi::Buffer<ffi::S32>>()                     \
                                    .Arg<ffi::Buffer<ffi::S32>>()                     \
                                    .Arg<ffi::Buffer<ffi::S32>>()                     \
                                    .Ret<ffi::Buffer<ffi::F32>>()                     \
                                    .Attr<float>("sm_scale")                          \
                                    .Attr<bool>("sparse"));

SJ_DECODE_HANDLER(sj_decode_attention_f32, ffi::F32, float)
SJ_DECODE_HANDLER(sj_decode_attention_bf16, ffi::BF16, uint16_t)

XLA_FFI_DEFINE_HANDLER_SYMBOL(sj_causal_attention_f32, CausalAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));
