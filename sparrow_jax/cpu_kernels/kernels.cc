// CPU kernels for the decode step, called from XLA through its FFI (see cpu_kernels/__init__.py).
//
// XLA:CPU multiplies a batch-1 activation by bfloat16 weights at ~1.5 GB/s and gathers paged
// K/V at ~5 GB/s (BENCHMARKS.md, issue 22); these loops stream both at the memory's rate.
//
//   sj_packed_matmul_{f32,bf16}  y[M, P*NB] = x[M, K] @ W, W packed as [P, K, NB] panels
//                                (each panel's NB output columns contiguous along K), float32
//                                accumulation.
//   sj_packed_swiglu_{f32,bf16}  y[M, F] = silu(x @ gate) * (x @ up) on the fused gate|up
//                                packing (2 F / NB panels), the products never stored
//   sj_cache_write_token         one token's K and V per slot into the paged cache, in place
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
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

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
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
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

// float32 -> bfloat16, rounding to nearest even (as XLA converts)
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
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

// One register tile of `rows` (<= 4) rows of one panel (panel_rows' arguments).
template <typename W>
inline void panel_tile(int64_t rows, const float* x, const W* panel, float* y, int64_t K,
                       int64_t ldy, int64_t m0, int64_t col0) {
  switch (rows) {
    case 4: panel_rows<W, 4>(x, panel, y, K, ldy, m0, col0); break;
    case 3: panel_rows<W, 3>(x, panel, y, K, ldy, m0, col0); break;
    case 2: panel_rows<W, 2>(x, panel, y, K, ldy, m0, col0); break;
    default: panel_rows<W, 1>(x, panel, y, K, ldy, m0, col0); break;
  }
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
      int64_t m0 = t * kMT;
      panel_tile<W>(std::min<int64_t>(kMT, M - m0), x, panel, y, K, ldy, m0, p * kNB);
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

// ---- bfloat16 packed matmul ----------------------------------------------------------------
//
// W packed as [P, K2, 128] bfloat16 (K2 = ceil(K / 2)): element (k, c) of a panel at
// [k / 2, 2 c + k % 2], so each 32-bit lane holds the pair (W[2i, c], W[2i + 1, c]). x is
// rounded to bfloat16 (to nearest even, as XLA's convert) and read as the same pairs, so one
// vdpbf16ps multiplies 16 columns by two k at once: bf16 x bf16 products summed in float32
// (what an XLA dot of bf16 operands with a float32 result computes). Without AVX512-BF16 the
// pairs are widened to float32 and multiplied with FMAs (the same products).

// Rows [m0, m0 + MR) of one panel; a: the rows' bf16 pairs (row stride lda uint32).
template <int MR>
inline void bf16_panel_rows(const uint32_t* a, int64_t lda, const uint16_t* panel, int64_t K2,
                            float* y, int64_t ldy, int64_t col0) {
#if defined(__AVX512BF16__)
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K2; ++kk) {
    const uint16_t* wr = panel + kk * 2 * kNB;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wr + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(wr + 96);
    for (int m = 0; m < MR; ++m) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(int(a[m * lda + kk]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], av, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], av, w1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], av, w2);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], av, w3);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + m * ldy + col0 + 16 * j, acc[m][j]);
#else
  v16 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = v16{};
  const u32x16 hi_mask = u32x16{} + 0xffff0000u;
  for (int64_t kk = 0; kk < K2; ++kk) {
    const uint16_t* wr = panel + kk * 2 * kNB;
    v16 we[4], wo[4];
    for (int j = 0; j < 4; ++j) {
      u32x16 w;
      std::memcpy(&w, wr + 32 * j, sizeof(w));
      const u32x16 e = w << 16, o = w & hi_mask;
      std::memcpy(&we[j], &e, sizeof(e));
      std::memcpy(&wo[j], &o, sizeof(o));
    }
    for (int m = 0; m < MR; ++m) {
      const uint32_t u = a[m * lda + kk], ue = u << 16, uo = u & 0xffff0000u;
      float xe, xo;
      std::memcpy(&xe, &ue, 4);
      std::memcpy(&xo, &uo, 4);
      for (int j = 0; j < 4; ++j) acc[m][j] += xe * we[j] + xo * wo[j];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) std::memcpy(y + m * ldy + col0 + 16 * j, &acc[m][j], 64);
#endif
}

constexpr int64_t kBF16MR = 6;  // rows per register tile (6 x 4 accumulators)

// x [M, K] rounded to bfloat16 pairs [M, K2] (zero past K), the operand of bf16_panel_rows.
std::unique_ptr<uint32_t[]> round_rows_bf16(ffi::ThreadPool& pool, const float* x, int64_t M,
                                            int64_t K, int64_t K2) {
  std::unique_ptr<uint32_t[]> a(new uint32_t[M * K2]);
  const int64_t row_items = std::max<int64_t>(1, std::min<int64_t>(M, 64));
  parallel_for(pool, row_items, [&](int64_t item) {
    for (int64_t m = item; m < M; m += row_items) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(a.get() + m * K2);
      const float* src = x + m * K;
      int64_t k = 0;
#if defined(__AVX512BF16__)
      for (; k + 16 <= K; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
#endif
      for (; k < K; ++k) dst[k] = f32_to_bf16(src[k]);
      if (K % 2) dst[K] = 0;
    }
  });
  return a;
}

// One register tile of `rows` (<= kBF16MR) rows of one panel into y (row stride ldy).
inline void bf16_tile(int64_t rows, const uint32_t* a, int64_t K2, const uint16_t* panel,
                      float* y, int64_t ldy, int64_t col0) {
  switch (rows) {
    case 6: bf16_panel_rows<6>(a, K2, panel, K2, y, ldy, col0); break;
    case 5: bf16_panel_rows<5>(a, K2, panel, K2, y, ldy, col0); break;
    case 4: bf16_panel_rows<4>(a, K2, panel, K2, y, ldy, col0); break;
    case 3: bf16_panel_rows<3>(a, K2, panel, K2, y, ldy, col0); break;
    case 2: bf16_panel_rows<2>(a, K2, panel, K2, y, ldy, col0); break;
    default: bf16_panel_rows<1>(a, K2, panel, K2, y, ldy, col0); break;
  }
}

// Row blocks of 16 register tiles: an item (a block x one output panel) keeps its weight
// panel(s) in cache across the block's tiles, and the block's rows across its panels.
constexpr int64_t kBF16Block = 16 * kBF16MR;

ffi::Error packed_matmul_bf16(ffi::ThreadPool pool, const float* x, const uint16_t* w,
                              float* y, int64_t M, int64_t K, int64_t K2, int64_t P) {
  const int64_t ldy = P * kNB;
  std::unique_ptr<uint32_t[]> a = round_rows_bf16(pool, x, M, K, K2);
  const int64_t blocks = (M + kBF16Block - 1) / kBF16Block;
  parallel_for(pool, blocks * P, [&](int64_t item) {
    const int64_t rb = item / P, p = item % P;
    const uint16_t* panel = w + p * K2 * 2 * kNB;
    const int64_t m_end = std::min(M, (rb + 1) * kBF16Block);
    for (int64_t m0 = rb * kBF16Block; m0 < m_end; m0 += kBF16MR)
      bf16_tile(std::min<int64_t>(kBF16MR, m_end - m0), a.get() + m0 * K2, K2, panel,
                y + m0 * ldy, ldy, p * kNB);
  });
  return ffi::Error::Success();
}

ffi::Error PackedMatmulBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != 2 * kNB || wd[1] != (xd[1] + 1) / 2)
    return ffi::Error::InvalidArgument(
        "sj_packed_matmul_bf16: expected x [M, K], w [P, ceil(K / 2), 128]");
  return packed_matmul_bf16(pool, x.typed_data(),
                            reinterpret_cast<const uint16_t*>(w.typed_data()),
                            y->typed_data(), xd[0], xd[1], wd[1], wd[0]);
}

// exp of 16 floats: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial (relative
// error ~2e-7); inputs below -86 (masked scores, -inf) give exactly 0, never a denormal
// (arithmetic on a denormal operand can cost a microcode assist per instruction).
inline v16 exp16(v16 x) {
  const v16 lo = v16{} - 86.0f, hi = v16{} + 88.0f;
  const v16 x_in = x;
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
  return x_in < lo ? v16{} : out;
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

// ---- SwiGLU on the fused gate|up packing ------------------------------------------------------
//
// W = [gate | up] packed as 2 * P2 panels (gate's in [0, P2), up's in [P2, 2 P2); the MLP's
// width F = 64 P2). y [M, F] = silu(x @ gate) * (x @ up): each register tile's gate and up
// products land in a scratch tile in L1 and only their SwiGLU is written, so the [M, 2F]
// products never reach memory (nor does a separate elementwise pass read them back).

// y[r, :64] = silu(g[r]) * u[r] for `rows` rows of 64 (g, u row stride kNB). Not inlined:
// inlined into the tile loop, the compiler keeps exp's constants in vector registers across
// it and the GEMM's 24 accumulators spill (the SwiGLU GEMM ran 2.3x slower).
__attribute__((noinline)) void swiglu_rows(const float* g, const float* u, int64_t rows,
                                           float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < kNB; c += 16) {
      const v16 gv = load16(g + r * kNB + c), uv = load16(u + r * kNB + c);
      const v16 out = gv / (1.0f + exp16(-gv)) * uv;
      std::memcpy(y + r * ldy + c, &out, sizeof(out));
    }
}

ffi::Error packed_swiglu_bf16(ffi::ThreadPool pool, const float* x, const uint16_t* w,
                              float* y, int64_t M, int64_t K, int64_t K2, int64_t P2) {
  const int64_t ldy = P2 * kNB;
  std::unique_ptr<uint32_t[]> a = round_rows_bf16(pool, x, M, K, K2);
  const int64_t blocks = (M + kBF16Block - 1) / kBF16Block;
  parallel_for(pool, blocks * P2, [&](int64_t item) {
    const int64_t rb = item / P2, p = item % P2;
    const uint16_t* gate = w + p * K2 * 2 * kNB;
    const uint16_t* up = w + (P2 + p) * K2 * 2 * kNB;
    alignas(64) float g[kBF16MR * kNB], u[kBF16MR * kNB];
    const int64_t m_end = std::min(M, (rb + 1) * kBF16Block);
    for (int64_t m0 = rb * kBF16Block; m0 < m_end; m0 += kBF16MR) {
      const int64_t rows = std::min<int64_t>(kBF16MR, m_end - m0);
      bf16_tile(rows, a.get() + m0 * K2, K2, gate, g, kNB, 0);
      bf16_tile(rows, a.get() + m0 * K2, K2, up, u, kNB, 0);
      swiglu_rows(g, u, rows, y + m0 * ldy + p * kNB, ldy);
    }
  });
  return ffi::Error::Success();
}

ffi::Error packed_swiglu_f32(ffi::ThreadPool pool, const float* x, const float* w, float* y,
                             int64_t M, int64_t K, int64_t P2) {
  const int64_t ldy = P2 * kNB;
  constexpr int64_t kMT = 4;
  const int64_t mtiles = (M + kMT - 1) / kMT;
  parallel_for(pool, P2 * mtiles, [&](int64_t item) {
    const int64_t p = item / mtiles, m0 = (item % mtiles) * kMT;
    const int64_t rows = std::min<int64_t>(kMT, M - m0);
    alignas(64) float g[kMT * kNB], u[kMT * kNB];
    // x rows m0.. into scratch rows 0..
    panel_tile<float>(rows, x + m0 * K, w + p * K * kNB, g, K, kNB, 0, 0);
    panel_tile<float>(rows, x + m0 * K, w + (P2 + p) * K * kNB, u, K, kNB, 0, 0);
    swiglu_rows(g, u, rows, y + m0 * ldy + p * kNB, ldy);
  });
  return ffi::Error::Success();
}

// x [M, K] float32, w [2 P2, K, 64] float32 or [2 P2, ceil(K / 2), 128] bfloat16 -> y [M, 64 P2].
template <ffi::DataType T>
ffi::Error PackedSwiglu(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  constexpr bool bf16 = T == ffi::BF16;
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[0] % 2 != 0 ||
      wd[2] != (bf16 ? 2 * kNB : kNB) || wd[1] != (bf16 ? (xd[1] + 1) / 2 : xd[1]))
    return ffi::Error::InvalidArgument(
        "sj_packed_swiglu: expected x [M, K], w [2 P2, K, 64] (float32) or "
        "[2 P2, ceil(K / 2), 128] (bfloat16)");
  if constexpr (bf16)
    return packed_swiglu_bf16(pool, x.typed_data(),
                              reinterpret_cast<const uint16_t*>(w.typed_data()),
                              y->typed_data(), xd[0], xd[1], wd[1], wd[0] / 2);
  else
    return packed_swiglu_f32(pool, x.typed_data(), w.typed_data(), y->typed_data(), xd[0],
                             xd[1], wd[0] / 2);
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

// 16 vectors -> one vector of their 16 horizontal sums (lane t = sum of p[t]): a tree of 15
// shuffle-and-add merges instead of 16 separate reductions.
inline v16 hsum16x16(const v16* p) {
  v16 r1[8], r2[4], r3[2];
  for (int i = 0; i < 8; ++i) {
    const v16 a = p[2 * i], b = p[2 * i + 1];
    r1[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                    30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const v16 a = r1[2 * i], b = r1[2 * i + 1];
    r2[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                    31);
  }
  for (int i = 0; i < 2; ++i) {
    const v16 a = r2[2 * i], b = r2[2 * i + 1];
    r3[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
            __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                    31);
  }
  const v16 a = r3[0], b = r3[1];
  const v16 r =
      __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
      __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // lane l holds token bitreverse4(l)
  return __builtin_shufflevector(r, r, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

constexpr int kMaxG = 8;  // query heads per kv head handled together (more: in groups)

// Pages of 16 tokens, D a multiple of 16, the G query heads of one kv head together (G a
// compile-time constant): a head's 16 scores stay in registers and become one vector
// (hsum16x16, one exp16); each V row is loaded (and widened from bf16) once for all G heads.
template <typename C, int G>
inline void page_update16(const float* q, const C* kpage, const C* vpage, int64_t valid,
                          int64_t D, float scale, float* m, float* l, float* acc) {
  const int64_t DV = D / 16;
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  alignas(64) float p[G][16];
  float corr[G];
  for (int g = 0; g < G; ++g) {
    v16 part[16];
    for (int t = 0; t < 16; ++t) part[t] = load16(q + g * D) * load16(kpage + t * D);
    for (int64_t c = 1; c < DV; ++c) {
      const v16 qc = load16(q + g * D + c * 16);
      for (int t = 0; t < 16; ++t) part[t] += qc * load16(kpage + t * D + c * 16);
    }
    v16 sc = hsum16x16(part) * scale;
    if (valid < 16) sc = lane >= float(valid) ? v16{} - INFINITY : sc;
    const float mx = std::max(m[g], hmax(sc));
    corr[g] = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first page
    const v16 e = exp16(sc - mx);
    std::memcpy(p[g], &e, sizeof(e));
    l[g] = l[g] * corr[g] + hsum(e);
    m[g] = mx;
  }
  for (int64_t c = 0; c < DV; ++c) {
    v16 a[G];
    for (int g = 0; g < G; ++g) a[g] = load16(acc + g * D + c * 16) * corr[g];
    for (int64_t t = 0; t < valid; ++t) {
      const v16 vv = load16(vpage + t * D + c * 16);
      for (int g = 0; g < G; ++g) a[g] += p[g][t] * vv;
    }
    for (int g = 0; g < G; ++g) std::memcpy(acc + g * D + c * 16, &a[g], sizeof(v16));
  }
}

// ---- bf16 cache: pair dot products -----------------------------------------------------------
//
// With a bfloat16 cache the query and each page's probabilities are rounded to bf16 too (as the
// bf16 prefill kernel does) and every product is bf16 x bf16 summed in float32: scores as
// (q[2i], q[2i+1]) . (k[2i], k[2i+1]) per token, values as (p[2j], p[2j+1]) . (v[2j][d],
// v[2j+1][d]) per column, one vdpbf16ps per 16 lanes x 2 (widened FMAs without AVX512-BF16).

inline u32x16 loadu32(const void* p) {
  u32x16 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

inline v16 dp16(v16 acc, u32x16 a, u32x16 b) {
#if defined(__AVX512BF16__)
  return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
#else
  const u32x16 hi = u32x16{} + 0xffff0000u;
  const u32x16 ae = a << 16, ao = a & hi, be = b << 16, bo = b & hi;
  v16 fae, fao, fbe, fbo;
  std::memcpy(&fae, &ae, 64);
  std::memcpy(&fao, &ao, 64);
  std::memcpy(&fbe, &be, 64);
  std::memcpy(&fbo, &bo, 64);
  return acc + fae * fbe + fao * fbo;
#endif
}

// Two rows of 32 bf16 -> the pairs (ra[k], rb[k]) for k < 16 (lo) and 16 <= k < 32 (hi).
inline void interleave_rows(const uint16_t* ra, const uint16_t* rb, u32x16& lo, u32x16& hi) {
#if defined(__AVX512BF16__)
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38,
                                               7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13,
                                               45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
                                               22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59,
                                               28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i a = _mm512_loadu_si512(ra), b = _mm512_loadu_si512(rb);
  lo = (u32x16)_mm512_permutex2var_epi16(a, _mm512_load_si512(kLo), b);
  hi = (u32x16)_mm512_permutex2var_epi16(a, _mm512_load_si512(kHi), b);
#else
  for (int k = 0; k < 16; ++k) {
    lo[k] = uint32_t(ra[k]) | (uint32_t(rb[k]) << 16);
    hi[k] = uint32_t(ra[16 + k]) | (uint32_t(rb[16 + k]) << 16);
  }
#endif
}

// G query heads (as bf16 pairs q2 [G, D / 2]) against one 16-token bf16 page; D % 32 == 0.
template <int G>
inline void page_update16_bf16(const uint32_t* q2, const uint16_t* kpage,
                               const uint16_t* vpage, int64_t valid, int64_t D, float scale,
                               float* m, float* l, float* acc) {
  const int64_t D2 = D / 2, DC = D / 32;
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  alignas(64) uint32_t p2[G][8];
  float corr[G];
  for (int g = 0; g < G; ++g) {
    v16 part[16];
    const u32x16 q0 = loadu32(q2 + g * D2);
    for (int t = 0; t < 16; ++t) part[t] = dp16(v16{}, q0, loadu32(kpage + t * D));
    for (int64_t c = 1; c < DC; ++c) {
      const u32x16 qc = loadu32(q2 + g * D2 + 16 * c);
      for (int t = 0; t < 16; ++t) part[t] = dp16(part[t], qc, loadu32(kpage + t * D + 32 * c));
    }
    v16 sc = hsum16x16(part) * scale;
    if (valid < 16) sc = lane >= float(valid) ? v16{} - INFINITY : sc;
    const float mx = std::max(m[g], hmax(sc));
    corr[g] = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first page
    const v16 e = exp16(sc - mx);
    uint16_t* pb = reinterpret_cast<uint16_t*>(p2[g]);
#if defined(__AVX512BF16__)
    _mm256_store_si256(reinterpret_cast<__m256i*>(pb), (__m256i)_mm512_cvtneps_pbh((__m512)e));
#else
    for (int k = 0; k < 16; ++k) pb[k] = f32_to_bf16(e[k]);
#endif
    l[g] = l[g] * corr[g] + hsum(load16(pb));  // the sum of the probabilities as used
    m[g] = mx;
  }
  const int64_t pairs = (valid + 1) / 2;
  for (int64_t c = 0; c < DC; ++c) {
    v16 a0[G], a1[G];
    for (int g = 0; g < G; ++g) {
      a0[g] = load16(acc + g * D + 32 * c) * corr[g];
      a1[g] = load16(acc + g * D + 32 * c + 16) * corr[g];
    }
    for (int64_t j = 0; j < pairs; ++j) {
      u32x16 lo, hi;
      interleave_rows(vpage + 2 * j * D + 32 * c, vpage + (2 * j + 1) * D + 32 * c, lo, hi);
      for (int g = 0; g < G; ++g) {
        const u32x16 pj = u32x16{} + p2[g][j];
        a0[g] = dp16(a0[g], pj, lo);
        a1[g] = dp16(a1[g], pj, hi);
      }
    }
    for (int g = 0; g < G; ++g) {
      std::memcpy(acc + g * D + 32 * c, &a0[g], sizeof(v16));
      std::memcpy(acc + g * D + 32 * c + 16, &a1[g], sizeof(v16));
    }
  }
}

// All query heads of a kv head (in groups of kMaxG) against one page. A bf16 page takes the
// pair products when `q2` (the queries as bf16 pairs) is given, else it is widened to float32
// once (`wide`, 2 x 16 x D floats) rather than once per head.
template <typename C>
inline void page_update16_heads(const float* q, const C* kpage, const C* vpage, int64_t valid,
                                int64_t G, int64_t D, float scale, float* m, float* l,
                                float* acc, float* wide, const uint32_t* q2 = nullptr) {
  if constexpr (!std::is_same<C, float>::value) {
    if (q2 != nullptr) {  // bf16 pair products (D % 32 == 0)
      for (int64_t g0 = 0; g0 < G; g0 += kMaxG) {
        const uint32_t* qg = q2 + g0 * (D / 2);
        float *mg = m + g0, *lg = l + g0, *ag = acc + g0 * D;
        switch (std::min<int64_t>(kMaxG, G - g0)) {
#define SJ_G(n) \
  case n: page_update16_bf16<n>(qg, kpage, vpage, valid, D, scale, mg, lg, ag); break;
          SJ_G(1) SJ_G(2) SJ_G(3) SJ_G(4) SJ_G(5) SJ_G(6) SJ_G(7) SJ_G(8)
#undef SJ_G
        }
      }
      return;
    }
    for (int64_t i = 0; i < 16 * D; i += 16) {
      const v16 kw = load16(kpage + i), vw = load16(vpage + i);
      std::memcpy(wide + i, &kw, sizeof(kw));
      std::memcpy(wide + 16 * D + i, &vw, sizeof(vw));
    }
    page_update16_heads<float>(q, wide, wide + 16 * D, valid, G, D, scale, m, l, acc, nullptr);
    return;
  }
  const float* kf = reinterpret_cast<const float*>(kpage);
  const float* vf = reinterpret_cast<const float*>(vpage);
  for (int64_t g0 = 0; g0 < G; g0 += kMaxG) {
    const float* qg = q + g0 * D;
    float *mg = m + g0, *lg = l + g0, *ag = acc + g0 * D;
    switch (std::min<int64_t>(kMaxG, G - g0)) {
#define SJ_G(n) \
  case n: page_update16<float, n>(qg, kf, vf, valid, D, scale, mg, lg, ag); break;
      SJ_G(1) SJ_G(2) SJ_G(3) SJ_G(4) SJ_G(5) SJ_G(6) SJ_G(7) SJ_G(8)
#undef SJ_G
    }
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
  std::vector<float> wide(vec16 && !std::is_same<C, float>::value ? 2 * 16 * D + 16 : 0);
  // bf16 cache, D % 32 == 0: the queries as bf16 pairs for the pair dot products
  const bool pairs = vec16 && !std::is_same<C, float>::value && D % 32 == 0;
  std::vector<uint32_t> q2(pairs ? G * D / 2 : 0);
  if (pairs) {
    uint16_t* q16 = reinterpret_cast<uint16_t*>(q2.data());
    for (int64_t i = 0; i < G * D; ++i) q16[i] = f32_to_bf16(q[i]);
  }
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
    if (j + 1 < npages) {  // pages are scattered: ask for the next one's lines now
      const char* kn = reinterpret_cast<const char*>(kp + int64_t(pages_phys[j + 1]) * S * D);
      const char* vn = reinterpret_cast<const char*>(vp + int64_t(pages_phys[j + 1]) * S * D);
      for (int64_t off = 0; off < int64_t(S * D * sizeof(C)); off += 64) {
        __builtin_prefetch(kn + off);
        __builtin_prefetch(vn + off);
      }
    }
    if (vec16) {
      page_update16_heads<C>(q, kpage, vpage, valid, G, D, scale, m_out, l_out, acc_out,
                             wide.data(), pairs ? q2.data() : nullptr);
    } else {
      for (int64_t g = 0; g < G; ++g)
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
constexpr int kQR = 4;   // query rows per tile (the score loops below are written out for 4)

// A tile's outputs: each row's accumulator over its softmax sum; rows past the length 0.
inline void finish_rows(const float* acc, const float* l, int64_t rows, int64_t r0,
                        int64_t len, int64_t D, float* oh, int64_t ldo) {
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

// The largest of a 64-key block's scores (four vectors, one horizontal reduction).
inline float block_max(const v16 (&blk)[4]) {
  const v16 a = blk[0] > blk[1] ? blk[0] : blk[1], b = blk[2] > blk[3] ? blk[2] : blk[3];
  return hmax(a > b ? a : b);
}

// Online softmax: the new running max of a row and the factor its sum and accumulator take
// (exactly 1, and no rescale, when the block does not raise the max: the common case after
// the first blocks).
inline float raise_max(float& m, float block_mx, float* acc_row, int64_t D) {
  if (!(block_mx > m)) return 1.f;
  const float corr = std::exp(m - block_mx);
  m = block_mx;
  for (int64_t d = 0; d < D; d += 16) store16(acc_row + d, load16(acc_row + d) * corr);
  return corr;
}

// Whether q [B, T, H, D] and k / v [B, T, KV, D] fit the causal kernels (D % 64 == 0).
inline bool causal_shapes_ok(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd) {
  return qd.size() == 4 && kd.size() == 4 && kd[0] == qd[0] && kd[1] == qd[1] &&
         kd[3] == qd[3] && qd[2] % kd[2] == 0 && qd[3] % 64 == 0;
}

// Runs tile(b, h, kv head, first row, length, acc [kQR, D]) for every (row, query head, tile
// of kQR queries), the longest (last) tiles first.
template <typename Tile>
void for_each_tile(ffi::ThreadPool& pool, int64_t B, int64_t T, int64_t H, int64_t G,
                   int64_t D, const int32_t* lengths, const Tile& tile_fn) {
  const int64_t tiles = (T + kQR - 1) / kQR;
  parallel_for(pool, B * H * tiles, [&](int64_t item) {
    const int64_t tile = tiles - 1 - item / (B * H);
    const int64_t bh = item % (B * H);
    const int64_t b = bh / H, h = bh % H;
    const int64_t len = std::min<int64_t>(T, std::max<int32_t>(0, lengths[b]));
    std::vector<float> acc(kQR * D);
    tile_fn(b, h, h / G, tile * kQR, len, acc.data());
  });
}

// Rows [r0, r0 + kQR) of one query head (rows >= T are not written). qh: the head's rows,
// row stride ldq; kt: the kv head's keys transposed in blocks of kKB keys [Tp / kKB][D][kKB]
// (Tp = T padded to kKB; a block contiguous: its D rows 256 bytes apart rather than Tp, 4 KB
// at T = 1024, which maps them to the same L1 sets); vh: its values, row stride ldv; out row
// stride ldo.
void causal_tile(const float* qh, int64_t ldq, const float* kt, const float* vh,
                 int64_t ldv, float* oh, int64_t ldo, int64_t r0, int64_t T, int64_t len,
                 int64_t D, float scale, float* acc /* [kQR, D] */) {
  const int64_t rows = std::min<int64_t>(kQR, T - r0);
  float m[kQR], l[kQR];
  for (int r = 0; r < kQR; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
  std::fill(acc, acc + kQR * D, 0.f);
  const int64_t last = std::min(r0 + rows - 1, len - 1);  // the tile's last query with keys
  float p[kQR][kKB];
  for (int64_t j0 = 0; j0 <= last; j0 += kKB) {
    v16 s[kQR][4];
    for (int r = 0; r < kQR; ++r)
      for (int c = 0; c < 4; ++c) s[r][c] = v16{};
    for (int64_t d = 0; d < D; ++d) {
      const float* kr = kt + j0 * D + d * kKB;
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
    for (int r = 0; r < kQR; ++r) {
      const int64_t i = r0 + r;
      if (r >= rows || i >= len) {  // no keys: zero probabilities, the value loop stays branchless
        std::fill(p[r], p[r] + kKB, 0.f);
        continue;
      }
      const int64_t lim = std::min<int64_t>(i, len - 1) - j0;  // keys j0 .. j0 + lim visible
      v16 blk[4];
      const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      const v16 ninf = v16{} - INFINITY;
      for (int c = 0; c < 4; ++c) {
        v16 sc = s[r][c] * scale;
        if (lim < (c + 1) * 16 - 1) sc = (lane + float(c * 16)) > float(lim) ? ninf : sc;
        blk[c] = sc;
      }
      const float corr = raise_max(m[r], block_max(blk), acc + r * D, D);
      const float mx = m[r];
      v16 tot{};
      for (int c = 0; c < 4; ++c) {
        const v16 e = exp16(blk[c] - mx);
        std::memcpy(p[r] + c * 16, &e, sizeof(e));
        tot += e;
      }
      l[r] = l[r] * corr + hsum(tot);
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
          const float pv = p[r][j];
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
  finish_rows(acc, l, rows, r0, len, D, oh, ldo);
}

// q [B, T, H, D], k / v [B, T, KV, D] float32, lengths [B] -> out [B, T, H, D]; D % 64 == 0.
ffi::Error CausalAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out,
                           float scale) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (!causal_shapes_ok(qd, kd))
    return ffi::Error::InvalidArgument(
        "sj_causal_attention: expected q [B, T, H, D], k/v [B, T, KV, D], D % 64 == 0");
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3], KV = kd[2], G = H / KV;
  const int64_t Tp = (T + kKB - 1) / kKB * kKB;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* lp = lengths.typed_data();
  float* op = out->typed_data();
  // Keys transposed per (row, kv head) in blocks of kKB keys: [B, KV, Tp / kKB, D, kKB],
  // zero past T.
  std::vector<float> kt(B * KV * D * Tp, 0.f);
  parallel_for(pool, B * KV, [&](int64_t bh) {
    const int64_t b = bh / KV, h = bh % KV;
    float* dst = kt.data() + bh * D * Tp;
    for (int64_t t = 0; t < T; ++t) {
      const float* src = kp + ((b * T + t) * KV + h) * D;
      float* blk = dst + (t / kKB) * D * kKB + t % kKB;
      for (int64_t d = 0; d < D; ++d) blk[d * kKB] = src[d];
    }
  });
  for_each_tile(pool, B, T, H, G, D, lp, [&](int64_t b, int64_t h, int64_t kvh, int64_t r0,
                                              int64_t len, float* acc) {
    causal_tile(qp + (b * T * H + h) * D, H * D, kt.data() + (b * KV + kvh) * D * Tp,
                vp + (b * T * KV + kvh) * D, KV * D, op + (b * T * H + h) * D, H * D, r0, T,
                len, D, scale, acc);
  });
  return ffi::Error::Success();
}

// ---- causal prefill attention, bfloat16 operands ------------------------------------------
//
// The same tiles with q, k, v rounded to bfloat16 and each row's probabilities rounded to
// bfloat16 before the value product (as a bf16 flash attention does); softmax statistics and
// accumulators in float32. Operands are bf16 pairs (uint32): scores take (q[2i], q[2i+1]) x
// (k[2i], k[2i+1]) per key; the value product takes (p[2j], p[2j+1]) x (v[2j], v[2j+1]) per
// column, one vdpbf16ps for 16 keys or columns x 2.

// acc + the 16 lanes' pair dot products of the broadcast pair `a` with the 16 pairs at w.
inline v16 dot2(v16 acc, uint32_t a, const uint32_t* w) {
#if defined(__AVX512BF16__)
  return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32(int(a)),
                               (__m512bh)_mm512_loadu_si512(w));
#else
  u32x16 wv;
  std::memcpy(&wv, w, sizeof(wv));
  const u32x16 e = wv << 16, o = wv & (u32x16{} + 0xffff0000u);
  v16 we, wo;
  std::memcpy(&we, &e, sizeof(e));
  std::memcpy(&wo, &o, sizeof(o));
  const uint32_t ue = a << 16, uo = a & 0xffff0000u;
  float xe, xo;
  std::memcpy(&xe, &ue, 4);
  std::memcpy(&xo, &uo, 4);
  return acc + xe * we + xo * wo;
#endif
}

// Rows [r0, r0 + kQR) of one query head. q2: the head's rows as bf16 pairs [T][D / 2] (row
// stride ldq2); kt2: keys as pairs transposed in blocks of kKB keys [Tp / kKB][D / 2][kKB]
// (as causal_tile's); v2: values paired over keys [Tp / 2][D] (zero past T).
void causal_tile_bf16(const uint32_t* q2, int64_t ldq2, const uint32_t* kt2,
                      const uint32_t* v2, float* oh, int64_t ldo, int64_t r0, int64_t T,
                      int64_t len, int64_t D, float scale, float* acc /* [kQR, D] */) {
  const int64_t rows = std::min<int64_t>(kQR, T - r0);
  const int64_t D2 = D / 2;
  float m[kQR], l[kQR];
  for (int r = 0; r < kQR; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
  std::fill(acc, acc + kQR * D, 0.f);
  const int64_t last = std::min(r0 + rows - 1, len - 1);
  alignas(64) uint32_t p2[kQR][kKB / 2];
  for (int64_t j0 = 0; j0 <= last; j0 += kKB) {
    // Rows past T repeat the last row (their results are never used): no branch in the loop,
    // so the 16 accumulators stay in registers.
    const uint32_t* qr[kQR];
    for (int r = 0; r < kQR; ++r) qr[r] = q2 + (r0 + std::min<int64_t>(r, rows - 1)) * ldq2;
    v16 s[kQR][4];
    {
      v16 t0 = {}, t1 = {}, t2 = {}, t3 = {}, t4 = {}, t5 = {}, t6 = {}, t7 = {};
      v16 t8 = {}, t9 = {}, t10 = {}, t11 = {}, t12 = {}, t13 = {}, t14 = {}, t15 = {};
      for (int64_t dp = 0; dp < D2; ++dp) {
        const uint32_t* kr = kt2 + j0 * D2 + dp * kKB;
        const uint32_t a0 = qr[0][dp], a1 = qr[1][dp], a2 = qr[2][dp], a3 = qr[3][dp];
        t0 = dot2(t0, a0, kr), t1 = dot2(t1, a0, kr + 16), t2 = dot2(t2, a0, kr + 32);
        t3 = dot2(t3, a0, kr + 48), t4 = dot2(t4, a1, kr), t5 = dot2(t5, a1, kr + 16);
        t6 = dot2(t6, a1, kr + 32), t7 = dot2(t7, a1, kr + 48), t8 = dot2(t8, a2, kr);
        t9 = dot2(t9, a2, kr + 16), t10 = dot2(t10, a2, kr + 32), t11 = dot2(t11, a2, kr + 48);
        t12 = dot2(t12, a3, kr), t13 = dot2(t13, a3, kr + 16), t14 = dot2(t14, a3, kr + 32);
        t15 = dot2(t15, a3, kr + 48);
      }
      s[0][0] = t0, s[0][1] = t1, s[0][2] = t2, s[0][3] = t3, s[1][0] = t4, s[1][1] = t5;
      s[1][2] = t6, s[1][3] = t7, s[2][0] = t8, s[2][1] = t9, s[2][2] = t10, s[2][3] = t11;
      s[3][0] = t12, s[3][1] = t13, s[3][2] = t14, s[3][3] = t15;
    }
    for (int r = 0; r < kQR; ++r) {
      const int64_t i = r0 + r;
      if (r >= rows || i >= len) {
        std::fill(p2[r], p2[r] + kKB / 2, 0u);
        continue;
      }
      const int64_t lim = std::min<int64_t>(i, len - 1) - j0;
      v16 blk[4];
      const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      const v16 ninf = v16{} - INFINITY;
      for (int c = 0; c < 4; ++c) {
        v16 sc = s[r][c] * scale;
        if (lim < (c + 1) * 16 - 1) sc = (lane + float(c * 16)) > float(lim) ? ninf : sc;
        blk[c] = sc;
      }
      const float corr = raise_max(m[r], block_max(blk), acc + r * D, D);
      const float mx = m[r];
      // The probabilities as the value product uses them (bf16, in key order: key pairs are
      // adjacent), and their sum from the same rounded values.
      uint16_t* pb = reinterpret_cast<uint16_t*>(p2[r]);
      v16 rounded{};
      for (int c = 0; c < 4; ++c) {
        const v16 e = exp16(blk[c] - mx);
#if defined(__AVX512BF16__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + 16 * c),
                            (__m256i)_mm512_cvtneps_pbh((__m512)e));
#else
        for (int j = 0; j < 16; ++j) pb[16 * c + j] = f32_to_bf16(e[j]);
#endif
        rounded += load16(pb + 16 * c);
      }
      l[r] = l[r] * corr + hsum(rounded);
    }
    const int64_t npairs = (std::min<int64_t>(kKB, last + 1 - j0) + 1) / 2;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      v16 o[kQR][4];
      for (int r = 0; r < kQR; ++r)
        for (int c = 0; c < 4; ++c) o[r][c] = load16(acc + r * D + d0 + c * 16);
      for (int64_t jp = 0; jp < npairs; ++jp) {
        const uint32_t* vr = v2 + (j0 / 2 + jp) * D + d0;
        for (int r = 0; r < kQR; ++r)
          for (int c = 0; c < 4; ++c) o[r][c] = dot2(o[r][c], p2[r][jp], vr + 16 * c);
      }
      for (int r = 0; r < kQR; ++r)
        for (int c = 0; c < 4; ++c) std::memcpy(acc + r * D + d0 + c * 16, &o[r][c], 64);
    }
  }
  finish_rows(acc, l, rows, r0, len, D, oh, ldo);
}

// q [B, T, H, D] float32 (rounded to bf16 here), k / v [B, T, KV, D] bfloat16, lengths [B]
// -> out [B, T, H, D] float32; D % 64 == 0.
ffi::Error CausalAttentionBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::BF16> k, ffi::Buffer<ffi::BF16> v,
                               ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out,
                               float scale) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (!causal_shapes_ok(qd, kd))
    return ffi::Error::InvalidArgument(
        "sj_causal_attention_bf16: expected q [B, T, H, D], k/v [B, T, KV, D], D % 64 == 0");
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3], KV = kd[2], G = H / KV;
  const int64_t D2 = D / 2;
  const int64_t Tp = (T + kKB - 1) / kKB * kKB;
  const float* qp = q.typed_data();
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.typed_data());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v.typed_data());
  const int32_t* lp = lengths.typed_data();
  float* op = out->typed_data();
  // Per (row, kv head): keys as pairs transposed in blocks of kKB keys [Tp / kKB, D2, kKB],
  // values paired over keys [Tp/2, D]; queries as pairs [B, T, H, D2]. Zero past T.
  std::vector<uint32_t> kt(B * KV * D2 * Tp, 0u), vt(B * KV * (Tp / 2) * D, 0u);
  std::vector<uint32_t> q2(B * T * H * D2);
  parallel_for(pool, B * KV, [&](int64_t bh) {
    const int64_t b = bh / KV, h = bh % KV;
    uint32_t* kdst = kt.data() + bh * D2 * Tp;
    uint32_t* vdst = vt.data() + bh * (Tp / 2) * D;
    for (int64_t t0 = 0; t0 < T; t0 += kKB) {
      const int64_t t1 = std::min<int64_t>(T, t0 + kKB);
      uint32_t* blk = kdst + t0 * D2;  // block t0 / kKB: [D2][kKB]
      for (int64_t dp = 0; dp < D2; ++dp) {
        uint32_t* row = blk + dp * kKB;
        for (int64_t t = t0; t < t1; ++t) {
          uint32_t pair;
          std::memcpy(&pair, kp + ((b * T + t) * KV + h) * D + 2 * dp, 4);
          row[t - t0] = pair;
        }
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      const uint16_t* vs = vp + ((b * T + t) * KV + h) * D;
      uint16_t* vrow = reinterpret_cast<uint16_t*>(vdst + (t / 2) * D);
      for (int64_t d = 0; d < D; ++d) vrow[2 * d + (t % 2)] = vs[d];
    }
  });
  parallel_for(pool, std::max<int64_t>(1, std::min<int64_t>(B * T, 64)), [&](int64_t item) {
    const int64_t step = std::max<int64_t>(1, std::min<int64_t>(B * T, 64));
    for (int64_t bt = item; bt < B * T; bt += step) {
      const float* src = qp + bt * H * D;
      uint32_t* dst = q2.data() + bt * H * D2;
      uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);  // pairs = bf16 in natural order
      int64_t i = 0;
#if defined(__AVX512BF16__)
      for (; i + 16 <= H * D; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d16 + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
      for (; i < H * D; ++i) d16[i] = f32_to_bf16(src[i]);
    }
  });
  for_each_tile(pool, B, T, H, G, D, lp, [&](int64_t b, int64_t h, int64_t kvh, int64_t r0,
                                              int64_t len, float* acc) {
    causal_tile_bf16(q2.data() + (b * T * H + h) * D2, H * D2,
                     kt.data() + (b * KV + kvh) * D2 * Tp,
                     vt.data() + (b * KV + kvh) * (Tp / 2) * D, op + (b * T * H + h) * D, H * D,
                     r0, T, len, D, scale, acc);
  });
  return ffi::Error::Success();
}

// ---- one token per slot into the paged cache, in place ---------------------------------------

// k / v caches [KV, P, S, D] (any dtype; the outputs alias them), k_rows / v_rows [KV, B, D] of
// that dtype, dest / off [B]: row b goes to page dest[b], offset off[b]; out-of-range entries
// write nothing. XLA:CPU widens a bfloat16 scatter to float32 and so converts the whole cache
// there and back at every decode step; this writes 2 x B x KV rows.
ffi::Error CacheWriteToken(ffi::AnyBuffer kc, ffi::AnyBuffer vc, ffi::AnyBuffer kr,
                           ffi::AnyBuffer vr, ffi::Buffer<ffi::S32> dest,
                           ffi::Buffer<ffi::S32> off, ffi::Result<ffi::AnyBuffer> kout,
                           ffi::Result<ffi::AnyBuffer> vout) {
  auto cd = kc.dimensions();
  auto rd = kr.dimensions();
  const bool same = vc.dimensions().size() == cd.size() && vr.dimensions().size() == rd.size() &&
                    std::equal(cd.begin(), cd.end(), vc.dimensions().begin()) &&
                    std::equal(rd.begin(), rd.end(), vr.dimensions().begin());
  if (cd.size() != 4 || rd.size() != 3 || !same || rd[0] != cd[0] || rd[2] != cd[3] ||
      kc.element_type() != kr.element_type() || vc.element_type() != kc.element_type() ||
      vr.element_type() != kc.element_type() || dest.element_count() != size_t(rd[1]) ||
      off.element_count() != size_t(rd[1]))
    return ffi::Error::InvalidArgument(
        "sj_cache_write_token: expected k/v caches [KV, P, S, D], rows [KV, B, D] of their "
        "dtype, dest / off [B]");
  const int64_t KV = cd[0], P = cd[1], S = cd[2], D = cd[3], B = rd[1];
  const size_t item = kc.size_bytes() / kc.element_count();
  const int32_t* dp = dest.typed_data();
  const int32_t* op = off.typed_data();
  auto write = [&](const ffi::AnyBuffer& cache, const ffi::AnyBuffer& rows, void* out) {
    char* dst = static_cast<char*>(out);
    if (dst != cache.untyped_data())  // XLA did not alias the buffers: start from a copy
      std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
    const char* src = static_cast<const char*>(rows.untyped_data());
    for (int64_t b = 0; b < B; ++b) {
      if (dp[b] < 0 || dp[b] >= P || op[b] < 0 || op[b] >= S) continue;
      for (int64_t h = 0; h < KV; ++h)
        std::memcpy(dst + (((h * P + dp[b]) * S + op[b]) * D) * item,
                    src + ((h * B + b) * D) * item, D * item);
    }
  };
  write(kc, kr, kout->untyped_data());
  write(vc, vr, vout->untyped_data());
  return ffi::Error::Success();
}

}  // namespace

// x [M, K] float32 and a packed weight of element type T -> y float32.
#define SJ_PACKED_HANDLER(name, fn, T)                                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, fn,                                             \
                                ffi::Ffi::Bind()                                      \
                                    .Ctx<ffi::ThreadPool>()                           \
                                    .Arg<ffi::Buffer<ffi::F32>>()                     \
                                    .Arg<ffi::Buffer<T>>()                            \
                                    .Ret<ffi::Buffer<ffi::F32>>());

SJ_PACKED_HANDLER(sj_packed_matmul_f32, PackedMatmulF32, ffi::F32)
SJ_PACKED_HANDLER(sj_packed_matmul_bf16, PackedMatmulBF16, ffi::BF16)
SJ_PACKED_HANDLER(sj_packed_swiglu_f32, PackedSwiglu<ffi::F32>, ffi::F32)
SJ_PACKED_HANDLER(sj_packed_swiglu_bf16, PackedSwiglu<ffi::BF16>, ffi::BF16)

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(sj_cache_write_token, CacheWriteToken,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(sj_causal_attention_bf16, CausalAttentionBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));
