// Matmuls on CPU for the weight types that are not 4-bit: 8-bit groups with float32 scales
// and optional minimums (Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS) and float16
// (every other type, rounded once at load).
//
// ds4::int8_linear_<isa>(x, q, scales, minimums=None) -> y          (isa: see isa.h)
//   x       [M, K] float32, rows may be strided, each row contiguous; used as they are
//   q       int8 [N / 16, K / G, G, 16]: 16 output columns over one group of G inputs (G = 16
//           or 32), the columns contiguous
//   scales  float32 or float16 [N / 16, K / G, 16], so that w = q * scale per column and group
//           (float16 for scales that are exactly float16 values, as Q8_0's are: widened on
//           load, which is exact, so either dtype gives the same bits; a decoded row streams
//           an eighth of a byte a weight less)
//   minimums  None, or float32 or float16 [N / 16, K / G, 16] (float16 where each is exactly
//           one, as Q5_1's are, widened like the scales): then w = q * scale + minimum
//   y       [M, N] float32 = x @ w.T
// ds4::kq_linear_<isa>(x, packed, sc, d, dmin=None) -> y    (AVX512BW builds only: avx512)
//   Q6_K, Q3_K or Q2_K matrices at their own width (repack.cpp's repack_kq lays them out): per
//   16 columns and 16 inputs one tile, packed uint8 [N / 16, K / 16, T], codes in
//   [input][column] order.  Q6_K (T = 192): 128 bytes of low nibbles (byte i holds code i in its
//   low nibble and code i + 128 in its high one), then 64 bytes of bits 4-5 in pairs; Q3_K
//   (T = 96): 64 bytes of bits 0-1 in pairs, then 32 bytes of bit 2 (byte i holds that of codes
//   i + 32 m at shift m); Q2_K (T = 64): the bit pairs alone.  A byte of pairs holds those of
//   codes i, i + 64, i + 128 and i + 192 at shifts 0, 2, 4 and 6.  sc int8 [N / 16, K / 16, 16]
//   and d (and for Q2_K dmin) float16 [N / 16, K / 256, 16], the file's own (Q3_K's 6-bit
//   scales minus 32; Q2_K's bytes of a scale and a minimum nibble): w = (code - 32, Q6_K;
//   code - 4, Q3_K) * (d * sc), or for Q2_K code * (d * (sc & 15)) + -(dmin * (sc >> 4)), each
//   product rounded to float32 once: exactly the int8 op's weights, scales and minimums for
//   these types, computed as it computes them (the same bits), from 0.82 (Q6_K), 0.45 (Q3_K) or
//   0.33 (Q2_K) bytes a weight instead of 1.25 (1.5 for Q2_K)
// ds4::f16_linear_<isa>(x, w) -> y
//   w       float16 [N / 16, ceil(K / 32), 32, 16], the same layout without scales; inputs past
//           K in the last group are ignored (zero-padded)
//
// Q8_0 (w = d * q, int8 q, groups of 32), Q6_K (w = d * sc * (q - 32), groups of 16, d * sc
// exact in float32) and the other types engine.quants unpacks to 8-bit groups keep their own
// numbers: the int8 op computes with exactly the file's weights, at a byte and an eighth
// (Q8_0) to a byte and a half (Q2_K: scale and minimum per 16) per weight, against float16's two.
//
// Per group, the dot product of x with the group's weights in four accumulators (input k goes
// to accumulator k % 4, in input order), (a0 + a1) + (a2 + a3), then y += scale * dot (y += dot
// for float16), then, with minimums, y += minimum * xsum, where xsum is the sum of the group's
// inputs in input order (computed once per row and group), groups in order.  A row's result
// depends on that row alone, in that fixed order: the same whatever the number of rows, the
// other rows and the thread count.  The code is
// written once in the compiler's generic vectors of 16 floats, lowered per instruction set, with
// a * b + c fused where the target has fused multiply-adds (GCC's default -ffp-contract=fast).
// Work is split over groups of 16 output columns; each group's weights are widened to float32
// once and used by every row.  Neither op adds biases.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "isa.h"

namespace {
namespace dense {  // named, so that all.cpp can include every source in one unit

constexpr int64_t C = 16;  // output columns per column group
typedef float vf __attribute__((vector_size(C * sizeof(float))));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Widening by intrinsics where the build has them: GCC lowers a generic int8 -> float vector
// conversion to one scalar conversion per lane.
inline vf widen(const int8_t* p) {
  vf r;
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&r, &v, sizeof r);
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  std::memcpy(&r, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<float*>(&r) + 8, &hi, sizeof hi);
#else
  float f[C];
  for (int i = 0; i < C; ++i) f[i] = static_cast<float>(p[i]);
  std::memcpy(&r, f, sizeof r);
#endif
  return r;
}

inline vf widen(const at::Half* p) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  vf r;
  std::memcpy(&r, &v, sizeof r);
  return r;
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  vf r;
  std::memcpy(&r, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<float*>(&r) + 8, &hi, sizeof hi);
  return r;
#else
  vf r;
  for (int i = 0; i < C; ++i) r[i] = static_cast<float>(p[i]);
  return r;
#endif
}

// One group's dot products for 16 columns: input k into accumulator k % 4, in input order.
// `Widened` gives input k's 16 weights as floats (from a buffer, or widened on the spot).
template <int G, typename Widened>
inline vf group_dot(const float* xv, Widened w) {
  vf a0{}, a1{}, a2{}, a3{};
#pragma GCC unroll 32  // fully: the accumulators stay in registers
  for (int k = 0; k < G; k += 4) {
    a0 += xv[k] * w(k);
    a1 += xv[k + 1] * w(k + 1);
    a2 += xv[k + 2] * w(k + 2);
    a3 += xv[k + 3] * w(k + 3);
  }
  return (a0 + a1) + (a2 + a3);
}

// A group's 16 scales as float32: float16 ones widened (exactly).
inline vf scales16(const float* p) { return loadv(p); }
inline vf scales16(const at::Half* p) { return widen(p); }

// Where a group's weights and scales come from.  `Stored`: a matrix held at its width (int8 or
// float16), with scales (`s0`) or without (null, float16), and minimums where the type has them.
// `KQuant`: Q6_K's, Q3_K's or Q2_K's tiles, each unpacked once into registers as int8 weights,
// the scale (and Q2_K's minimum) made from d (dmin) and sc.
template <typename W, int G, typename S>
struct Stored {
  using Weight = W;
  static constexpr int group = G;
  const W* w0;
  const S* s0;
  int64_t KB;
  const float* m0 = nullptr;  // minimums in float32 or float16, or none: pointers, not a template
  const at::Half* m16 = nullptr;  // parameter (instantiated per type, the several-row loop
                                  // compiled to code 1.5x slower)
  bool scaled() const { return s0 != nullptr; }
  bool has_minimums() const { return m0 != nullptr || m16 != nullptr; }
  // Input k's 16 weights of group (g, b) as floats, widened from memory on each call.
  auto weights(int64_t g, int64_t b) const {
    const W* wg = w0 + (g * KB + b) * G * C;
    return [wg](int k) { return widen(wg + k * C); };
  }
  vf scale(int64_t g, int64_t b) const { return s0 ? scales16(s0 + (g * KB + b) * C) : vf{}; }
  vf minimum(int64_t g, int64_t b) const {
    return m0 ? loadv(m0 + (g * KB + b) * C) : m16 ? widen(m16 + (g * KB + b) * C) : vf{};
  }
};

#if defined(__AVX512BW__)
// A k-quant tile's 256 weights as int8 (code - 32 for Q6_K, code - 4 for Q3_K) in four vectors
// of 64, [input][column] order (kq_linear's layout): vector m holds inputs 4 m .. 4 m + 3.
struct KTile {
  __m512i q[4];

  // Q6_K's 192 bytes: low nibbles (byte i: codes i and i + 128), then bits 4-5 in pairs.
  static KTile six(const uint8_t* tile) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i lo0 = _mm512_loadu_si512(tile), lo1 = _mm512_loadu_si512(tile + 64);
    const __m512i part[4] = {_mm512_and_si512(lo0, low4), _mm512_and_si512(lo1, low4),
                             _mm512_and_si512(_mm512_srli_epi16(lo0, 4), low4),
                             _mm512_and_si512(_mm512_srli_epi16(lo1, 4), low4)};
    return KTile(part, pairs(_mm512_loadu_si512(tile + 128), 4), 32);
  }

  // Q3_K's 96 bytes: bits 0-1 in pairs, then bit 2 (byte i: codes i + 32 m at shift m).
  static KTile three(const uint8_t* tile) {
    const __m512i none = _mm512_setzero_si512();
    const __m512i low[4] = {none, none, none, none};
    KTile t(low, pairs(_mm512_loadu_si512(tile), 0), 4);  // the bits 0-1, minus 4 (below)
    // bit 2 of codes 64 m + j: byte j % 32, shift 2 m + j / 32; the upper half shifted by one
    // (a 16-bit shift: the bit it brings from the next byte is bit 7, never used)
    const __m256i bit2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(bit2), _mm256_srli_epi16(bit2, 1), 1);
    const __m512i one = _mm512_set1_epi8(1);
    for (int m = 0; m < 4; ++m) {
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(both, 2 * m), one);
      t.q[m] = _mm512_add_epi8(t.q[m], _mm512_slli_epi16(high, 2));  // at most 3 + 4 - 4: no carry
    }
    return t;
  }

  // Q2_K's 64 bytes: bits 0-1 in pairs, the weight the code itself (its minimum is apart).
  static KTile two(const uint8_t* tile) {
    const __m512i none = _mm512_setzero_si512();
    const __m512i low[4] = {none, none, none, none};
    return KTile(low, pairs(_mm512_loadu_si512(tile), 0), 0);
  }

  // Input k's 16 weights as floats (k a constant once group_dot is unrolled: each case folds).
  vf operator()(int k) const {
    const __m512i v = q[k >> 2];
    __m128i lane;
    switch (k & 3) {
      case 0: lane = _mm512_castsi512_si128(v); break;
      case 1: lane = _mm512_extracti32x4_epi32(v, 1); break;
      case 2: lane = _mm512_extracti32x4_epi32(v, 2); break;
      default: lane = _mm512_extracti32x4_epi32(v, 3); break;
    }
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lane));
    vf r;
    std::memcpy(&r, &f, sizeof r);
    return r;
  }

 private:
  // Four vectors of bit pairs, pair m of each byte moved to bits `at`..`at` + 1 (masked before
  // each shift, so that no bit crosses into the neighbouring byte of a 16-bit lane).
  struct Pairs {
    __m512i p[4];
  };
  static Pairs pairs(__m512i bytes, int at) {
    const __m512i low2 = _mm512_set1_epi8(3);
    Pairs r;
    for (int m = 0; m < 4; ++m) {
      const __m512i field = _mm512_and_si512(_mm512_srli_epi16(bytes, 2 * m), low2);
      r.p[m] = at == 4 ? _mm512_slli_epi16(field, 4) : field;
    }
    return r;
  }
  KTile(const __m512i low[4], const Pairs& high, int bias) {
    const __m512i b = _mm512_set1_epi8(static_cast<char>(bias));
    for (int m = 0; m < 4; ++m) q[m] = _mm512_sub_epi8(_mm512_or_si512(low[m], high.p[m]), b);
  }
};

// Q6_K, Q3_K or Q2_K tiles (AVX512 builds only: elsewhere unpacking costs more than the bytes
// it saves, and the engine keeps these types in the int8 op).  Q6_K's and Q3_K's scale is
// d * sc (sc signed); Q2_K's sc byte holds a 4-bit scale and a 4-bit minimum:
// scale = d * (sc & 15), minimum = -(dmin * (sc >> 4)).
template <int TileBytes>
struct KQuant {
  using Weight = int8_t;
  static constexpr int group = 16;
  const uint8_t* t0;
  const int8_t* sc0;
  const at::Half* d0;
  int64_t KB;
  const at::Half* dmin0 = nullptr;  // Q2_K
  bool scaled() const { return true; }
  bool has_minimums() const { return TileBytes == 64; }
  KTile weights(int64_t g, int64_t b) const {
    const uint8_t* tile = t0 + (g * KB + b) * TileBytes;
    return TileBytes == 192 ? KTile::six(tile) : TileBytes == 96 ? KTile::three(tile) : KTile::two(tile);
  }
  vf scale(int64_t g, int64_t b) const {
    const vf d = widen(d0 + (g * (KB / 16) + b / 16) * C);
    return TileBytes == 64 ? d * nibbles(g, b, 0) : d * widen(sc0 + (g * KB + b) * C);
  }
  vf minimum(int64_t g, int64_t b) const {
    return -(widen(dmin0 + (g * (KB / 16) + b / 16) * C) * nibbles(g, b, 4));
  }

 private:
  // The 16 columns' 4-bit fields at `shift` of their sc bytes, as floats.
  vf nibbles(int64_t g, int64_t b, int shift) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc0 + (g * KB + b) * C));
    const __m128i field = _mm_and_si128(_mm_srli_epi16(bytes, shift), _mm_set1_epi8(0x0F));
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(field));
    vf r;
    std::memcpy(&r, &f, sizeof r);
    return r;
  }
};
#endif

// y = x @ w.T over column groups of 16 and input groups of G, the weights, scales and minimums
// from `src`.  A last group shorter than G (float16 only) reads x through a zero-padded copy;
// the padded weights are zero, so the padding adds exact zeros.
template <typename Source>
at::Tensor grouped_linear(const at::Tensor& x, const Source& src, int64_t NG, int64_t KB) {
  using W = typename Source::Weight;
  constexpr int G = Source::group;
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, NG * C}, x.options());
  if (M == 0) return y;
  const float* x0 = x.data_ptr<float>();
  const int64_t xs = x.stride(0), tail = K - (KB - 1) * G;
  std::vector<float> padded(tail < G ? M * G : 0, 0.0f);  // each row's last, partial group
  if (tail < G)
    for (int64_t r = 0; r < M; ++r) std::memcpy(padded.data() + r * G, x0 + r * xs + (KB - 1) * G, tail * sizeof(float));
  // Each row's group sums, for the minimums: a plain loop in input order, which the compiler
  // may not reassociate, so a row's sums never depend on the other rows.
  const bool mins = src.has_minimums(), scaled = src.scaled();
  std::vector<float> xsum(mins ? M * KB : 0);
  for (int64_t r = 0; mins && r < M; ++r)
    for (int64_t b = 0; b < KB; ++b) {
      const float* xg = x0 + r * xs + b * G;
      float sum = 0.0f;
      for (int k = 0; k < G; ++k) sum += xg[k];
      xsum[r * KB + b] = sum;
    }
  float* y0 = y.data_ptr<float>();
  at::parallel_for(0, NG, 1, [&](int64_t begin, int64_t end) {
    std::vector<vf> acc(M);
    std::vector<vf> wf(M > 1 ? G : 0);
    for (int64_t g = begin; g < end; ++g) {
      std::fill(acc.begin(), acc.end(), vf{});
      for (int64_t b = 0; b < KB; ++b) {
        const auto w = src.weights(g, b);
        const vf scale = src.scale(g, b);
        const vf minimum = mins ? src.minimum(g, b) : vf{};
        auto xrow = [&](int64_t r) {
          return b == KB - 1 && tail < G ? padded.data() + r * G : x0 + r * xs + b * G;
        };
        if (M == 1) {  // decoding: widen in registers, no buffer
          const vf dot = group_dot<G>(xrow(0), w);
          acc[0] = scaled ? scale * dot + acc[0] : dot + acc[0];
          if (mins) acc[0] = minimum * xsum[b] + acc[0];
          continue;
        }
        for (int k = 0; k < G; ++k) wf[k] = w(k);
        for (int64_t r = 0; r < M; ++r) {
          const vf dot = group_dot<G>(xrow(r), [&](int k) { return wf[k]; });
          acc[r] = scaled ? scale * dot + acc[r] : dot + acc[r];
          if (mins) acc[r] = minimum * xsum[r * KB + b] + acc[r];
        }
      }
      for (int64_t r = 0; r < M; ++r) std::memcpy(y0 + r * NG * C + g * C, &acc[r], sizeof(vf));
    }
  });
  return y;
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, op,
              ": x must be [M, K] float32 with contiguous rows");
}

DS4_ENTRY at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& minimums) {
  check_x(x, "int8_linear");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(3) == C &&
                  (q.size(2) == 16 || q.size(2) == 32),
              "int8_linear: q must be contiguous int8 [N/16, K/G, G, 16] with G 16 or 32");
  const int64_t NG = q.size(0), KB = q.size(1), Gq = q.size(2);
  TORCH_CHECK(x.size(1) == KB * Gq, "int8_linear: x has ", x.size(1), " inputs, the weights ", KB * Gq);
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == NG && scales.size(1) == KB && scales.size(2) == C,
              "int8_linear: scales must be contiguous float32 or float16 [N/16, K/G, 16]");
  const float* m = nullptr;
  const at::Half* m16 = nullptr;
  if (minimums.has_value()) {
    const at::Tensor& mt = *minimums;
    TORCH_CHECK((mt.scalar_type() == at::kFloat || mt.scalar_type() == at::kHalf) && mt.is_contiguous() &&
                    mt.sizes() == scales.sizes(),
                "int8_linear: minimums must be contiguous float32 or float16 shaped like scales");
    if (mt.scalar_type() == at::kHalf) {
      m16 = mt.data_ptr<at::Half>();
    } else {
      m = mt.data_ptr<float>();
    }
  }
  const int8_t* w = q.data_ptr<int8_t>();
  auto run = [&](const auto* s) {
    using S = std::remove_cv_t<std::remove_pointer_t<decltype(s)>>;
    return Gq == 32 ? grouped_linear(x, Stored<int8_t, 32, S>{w, s, KB, m, m16}, NG, KB)
                    : grouped_linear(x, Stored<int8_t, 16, S>{w, s, KB, m, m16}, NG, KB);
  };
  if (scales.scalar_type() == at::kHalf) return run(scales.data_ptr<at::Half>());
  return run(scales.data_ptr<float>());
}

at::Tensor f16_linear(const at::Tensor& x, const at::Tensor& w) {
  check_x(x, "f16_linear");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kHalf && w.is_contiguous() && w.size(2) == 32 && w.size(3) == C,
              "f16_linear: w must be contiguous float16 [N/16, ceil(K/32), 32, 16]");
  const int64_t NG = w.size(0), KB = w.size(1), K = x.size(1);
  TORCH_CHECK(K > (KB - 1) * 32 && K <= KB * 32, "f16_linear: x has ", K, " inputs, the weights ", KB, " groups of 32");
  return grouped_linear(x, Stored<at::Half, 32, float>{w.data_ptr<at::Half>(), nullptr, KB}, NG, KB);
}

#if defined(__AVX512BW__)
DS4_ENTRY at::Tensor kq_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc, const at::Tensor& d,
                               const c10::optional<at::Tensor>& dmin) {
  check_x(x, "kq_linear");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  (packed.size(2) == 192 || packed.size(2) == 96 || packed.size(2) == 64),
              "kq_linear: packed must be contiguous uint8 [N/16, K/16, 192 (Q6_K), 96 (Q3_K) or 64 (Q2_K)]");
  const int64_t NG = packed.size(0), KB = packed.size(1), T = packed.size(2);
  TORCH_CHECK(KB % 16 == 0 && x.size(1) == KB * 16, "kq_linear: x has ", x.size(1), " inputs, the weights ", KB * 16,
              " (a multiple of 256)");
  TORCH_CHECK(sc.scalar_type() == at::kChar && sc.is_contiguous() && sc.dim() == 3 && sc.size(0) == NG &&
                  sc.size(1) == KB && sc.size(2) == C,
              "kq_linear: sc must be contiguous int8 [N/16, K/16, 16]");
  auto super_values = [&](const at::Tensor& v) {
    return v.scalar_type() == at::kHalf && v.is_contiguous() && v.dim() == 3 && v.size(0) == NG &&
           v.size(1) == KB / 16 && v.size(2) == C;
  };
  TORCH_CHECK(super_values(d), "kq_linear: d must be contiguous float16 [N/16, K/256, 16]");
  TORCH_CHECK((T == 64) == dmin.has_value() && (!dmin.has_value() || super_values(*dmin)),
              "kq_linear: dmin, contiguous float16 [N/16, K/256, 16], goes with Q2_K's tiles and only with them");
  const uint8_t* t = packed.data_ptr<uint8_t>();
  const int8_t* s = sc.data_ptr<int8_t>();
  const at::Half* dd = d.data_ptr<at::Half>();
  if (T == 192) return grouped_linear(x, KQuant<192>{t, s, dd, KB}, NG, KB);
  if (T == 96) return grouped_linear(x, KQuant<96>{t, s, dd, KB}, NG, KB);
  return grouped_linear(x, KQuant<64>{t, s, dd, KB, dmin->data_ptr<at::Half>()}, NG, KB);
}
#endif

}  // namespace dense
}  // namespace

TORCH_LIBRARY_FRAGMENT(ds4, m) {
  m.def(DS4_OP("int8_linear") "(Tensor x, Tensor q, Tensor scales, Tensor? minimums=None) -> Tensor");
  m.def(DS4_OP("f16_linear") "(Tensor x, Tensor w) -> Tensor");
#if defined(__AVX512BW__)
  m.def(DS4_OP("kq_linear") "(Tensor x, Tensor packed, Tensor sc, Tensor d, Tensor? dmin=None) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(ds4, CPU, m) {
  m.impl(DS4_OP("int8_linear"), &dense::int8_linear);
  m.impl(DS4_OP("f16_linear"), &dense::f16_linear);
#if defined(__AVX512BW__)
  m.impl(DS4_OP("kq_linear"), &dense::kq_linear);
#endif
}
