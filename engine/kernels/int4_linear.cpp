// 4-bit grouped matmul on CPU: one contract, one implementation per instruction set.
//
// ds4::int4_linear_<isa>(x, packed, scales) -> y
// ds4::int4_linear_add_<isa>(x, packed, scales, out): out += y, into the first out.size(1) columns
//   (the vector ops only: avx512, avx2, portable), each output added once as `out += y` would
//   isa     avx512 (AVX512-BF16 vectors), amx (AMX-BF16 tiles), avx2 (AVX2 + FMA), portable
//           (the compiler's own vectors: NEON on aarch64, SSE2 on a bare x86-64)
//   x       [M, K] float32, rows may be strided, each row contiguous; rounded to bfloat16
//           (nearest even, subnormals to zero) on entry
//   packed  uint8 [N / 16, K / 32, 8, 32]: the 4-bit values q of 16 output columns over one
//           group of 32 inputs (layout: see int4_pack in engine/weights.py)
//   scales  float32 or float16 [N / 16, K / 32, 2, 16]: per column and group, scale and
//           minimum, so that w = q * scale + minimum
//   high    (avx512 only) None, or uint8 [N / 16, K / 32, 16, 4]: a fifth bit per weight, so
//           that q = nibble + 16 * bit (0..31): Q5_0, Q5_1 and Q5_K.  Entry [.., p, :] is a
//           little-endian 32-bit mask over the 32 bytes of the chunk that holds input pair p
//           (chunk p % 8, low nibbles for p < 8, high ones from 8): bit i for byte i
//   levels  (avx512 only) None, or float32 [16]: the value of each 4-bit code (IQ4_NL's and
//           IQ4_XS's non-uniform levels), integers of magnitude at most 256 (exact in
//           bfloat16); not with `high`
//   y       [M, N] float32 = x @ w.T
// Q4_0, Q4_1 and Q4_K all have this form; with `high` or `levels`, Q5_0, Q5_1, Q5_K, IQ4_NL and
// IQ4_XS too, on the avx512 op, whose nibbles already go through a table of 32 entries (one
// masked add puts a fifth bit into the index); the avx2 and portable ops refuse them (AVX2's
// one-row op converts nibbles in place, which a fifth bit or a table of levels breaks), and
// engine.weights keeps those types in the int8 op there.
// Float16 scales are for weights whose every scale and minimum is exactly a float16 (repack.cpp
// chooses): they are widened to float32 on load, which is exact, so an op gives the same bits
// with either dtype.  Float32 scales are a third of the
// bytes a decoding step streams; float16 ones save half of that.  Arithmetic stays float32.
//
// Per group, one dot product of the rounded x with q and two fused multiply-adds:
// y += scale * (x . q) + minimum * sum(x).  The products x * q are exact in float32 (8 by 4
// significant bits).  The avx512, avx2 and portable ops sum them in one order: for input pairs
// p = 0..15, accumulator p % 4 takes the odd input's product, then the even one's, each with
// one rounding (what VDPBF16PS specifies), and the group's dot product is (a0 + a1) + (a2 + a3).
// With fused multiply-adds (avx512, avx2, and the portable build where the target has them)
// those ops compute the same bits, subnormal intermediates aside (VDPBF16PS flushes them).
// The tile op sums a group's 32 products in the tile unit's own order, so its results can
// differ from the others' in the last bits of a group's dot product.  sum(x) per group is a
// fixed tree over the rounded values (round_rows), the same for every op.
//
// A row's result depends on that row alone, in one fixed order of operations per op: the
// same whatever the number of rows (one decoding row or a prefill chunk), the other rows and
// the thread count.  Work is split over groups of 16 output columns (pairs of them in the AVX2
// op from 16 rows on).  Each op exists only in the library built for its instruction set
// (isa.h).  The tile op asks the kernel for permission to use the tile registers (Linux
// arch_prctl) and raises if that is refused.
// None adds biases or handles K not divisible by 32.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"

#if defined(DS4_ISA_AVX512) || defined(DS4_ISA_AMX) || defined(DS4_ISA_AVX2)
#include <immintrin.h>
#endif
#if defined(DS4_ISA_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {
namespace int4 {  // named, so that all.cpp can include every source in one unit

constexpr int64_t G = 32;  // inputs per group
constexpr int64_t C = 16;  // output columns per column group

void check_arguments(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "int4_linear: x must be [M, K] float32 with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == 8 && packed.size(3) == 32,
              "int4_linear: packed must be contiguous uint8 [N/16, K/32, 8, 32]");
  const int64_t K = x.size(1), NG = packed.size(0), KB = packed.size(1);
  TORCH_CHECK(K == KB * G, "int4_linear: x has ", K, " inputs, the weights ", KB * G);
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous() &&
                  scales.dim() == 4 && scales.size(0) == NG && scales.size(1) == KB && scales.size(2) == 2 &&
                  scales.size(3) == C,
              "int4_linear: scales must be contiguous float32 or float16 [N/16, K/32, 2, 16]");
}

// A matrix's codes beyond plain nibbles: its fifth-bit masks, or its table of 16 levels.
struct Codes {
  const uint32_t* high = nullptr;
  const float* levels = nullptr;
  bool plain() const { return high == nullptr && levels == nullptr; }
};

Codes check_codes(const at::Tensor& packed, const c10::optional<at::Tensor>& high,
                  const c10::optional<at::Tensor>& levels) {
  Codes codes;
  if (high.has_value()) {
    const at::Tensor& h = *high;
    TORCH_CHECK(h.scalar_type() == at::kByte && h.is_contiguous() && h.dim() == 4 && h.size(0) == packed.size(0) &&
                    h.size(1) == packed.size(1) && h.size(2) == 16 && h.size(3) == 4,
                "int4_linear: high must be contiguous uint8 [N/16, K/32, 16, 4]");
    codes.high = static_cast<const uint32_t*>(h.const_data_ptr());
  }
  if (levels.has_value()) {
    const at::Tensor& l = *levels;
    TORCH_CHECK(l.scalar_type() == at::kFloat && l.is_contiguous() && l.dim() == 1 && l.size(0) == 16,
                "int4_linear: levels must be contiguous float32 [16]");
    TORCH_CHECK(codes.high == nullptr, "int4_linear: levels and high bits do not go together");
    codes.levels = l.const_data_ptr<float>();
    for (int i = 0; i < 16; ++i) {
      const float v = codes.levels[i];
      TORCH_CHECK(std::isfinite(v) && std::nearbyint(v) == v && std::abs(v) <= 256.0f,
                  "int4_linear: levels must be integers of magnitude at most 256");
    }
  }
  return codes;
}

// `body(S{})` with S the scales' element type: float, or uint16_t for float16 bits (each op
// widens those on load, 16 at a time).
template <typename Body>
auto with_scale_type(const at::Tensor& scales, Body body) {
  if (scales.scalar_type() == at::kHalf) return body(uint16_t{});
  return body(float{});
}

// float32 -> bfloat16 bits in the high half: nearest even, subnormal inputs to signed zero
// (as VCVTNE2PS2BF16 does), NaN kept a quiet NaN.  Branch-free, so loops over it vectorise.
inline uint32_t bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t mag = b & 0x7FFFFFFFu;
  uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  r = mag > 0x7F800000u ? ((b | 0x00400000u) & 0xFFFF0000u) : r;
  r = mag < 0x00800000u ? (b & 0x80000000u) : r;
  return r;
}

inline float bits_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Sum of a group's 32 rounded values: a fixed tree (halves, then 8, 4, 2, 1 lanes), the one
// every op uses.
inline float group_sum(const float* v) {
  float s[16], t[8], u[4];
  for (int i = 0; i < 16; ++i) s[i] = v[i] + v[16 + i];
  for (int i = 0; i < 8; ++i) t[i] = s[i] + s[8 + i];
  for (int i = 0; i < 4; ++i) u[i] = t[i] + t[4 + i];
  return (u[0] + u[2]) + (u[1] + u[3]);
}

// x rounded to bfloat16, stored as T (uint16_t: the bfloat16 bits; float: the rounded value),
// and each row's per-group sums of the rounded values ([rows, K / 32]).  Values are laid out
// by rows ([rows, K]) or, with `tile_rows`, by tiles: for each block of tile_rows rows and
// each group, the block's rows over that group, contiguous.  Rows from M to `rows` (padding)
// are zero.
template <typename T>
struct RoundedRows {
  std::vector<T> values;
  std::vector<float> sums;
};

template <typename T>
RoundedRows<T> round_rows(const at::Tensor& x, int64_t rows, int64_t tile_rows = 0) {
  const int64_t M = x.size(0), K = x.size(1), KB = K / G;
  RoundedRows<T> out{std::vector<T>(rows * K, T(0)), std::vector<float>(rows * KB, 0.0f)};
  const float* x0 = x.data_ptr<float>();
  float rounded[G];
  for (int64_t r = 0; r < M; ++r) {
    const float* row = x0 + r * x.stride(0);
    for (int64_t b = 0; b < KB; ++b) {
      for (int e = 0; e < G; ++e) rounded[e] = bits_float(bf16_bits(row[b * G + e]));
      const int64_t at = tile_rows ? ((r / tile_rows) * KB + b) * tile_rows * G + (r % tile_rows) * G : r * K + b * G;
      T* dst = out.values.data() + at;
      for (int e = 0; e < G; ++e) {
        if constexpr (sizeof(T) == 2) {
          uint32_t bits;
          std::memcpy(&bits, rounded + e, 4);
          dst[e] = static_cast<T>(bits >> 16);
        } else {
          dst[e] = rounded[e];
        }
      }
      out.sums[r * KB + b] = group_sum(rounded);
    }
  }
  return out;
}

// Where an op's results go: a new [M, N] tensor, or added into the first `columns` columns of
// an existing float32 [M, >= columns] one (int4_linear_add), one float addition per output, as
// `out += int4_linear(...)` rounds it.
struct Output {
  float* data;
  int64_t row_stride, columns;
  bool add;
};

// The shell of the vector ops: arguments checked, x rounded (stored as T), column groups split
// over threads in units of U groups (the last unit may hold fewer), each unit's running outputs
// per row accumulated over the input groups, then written out.  `group(q, sc, n, xr, b, acc)`
// adds input group b into acc ([M, U * 16]) for the unit's n column groups: q is the first
// one's 256 packed bytes, sc its 16 scales then 16 minimums (S: float or float16 bits), and the
// next column group's are KB * 256 bytes and KB * 32 scales further on.
template <typename T, typename S, int64_t U = 1, typename Group>
void vector_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const Output& out, Group group) {
  const int64_t M = x.size(0), NG = packed.size(0), KB = packed.size(1);
  if (M == 0) return;
  const RoundedRows<T> xr = round_rows<T>(x, M);
  const uint8_t* q0 = packed.data_ptr<uint8_t>();
  const S* s0 = static_cast<const S*>(scales.const_data_ptr());
  at::parallel_for(0, (NG + U - 1) / U, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * U * C);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u * U, n = std::min(U, NG - g);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = 0; b < KB; ++b) group(q0 + (g * KB + b) * 256, s0 + (g * KB + b) * 2 * C, n, xr, b, acc.data());
      const int64_t cols = std::min(n * C, out.columns - g * C);
      for (int64_t r = 0; r < M; ++r) {
        float* yr = out.data + r * out.row_stride + g * C;
        const float* ar = acc.data() + r * U * C;
        if (out.add) {
          for (int64_t j = 0; j < cols; ++j) yr[j] += ar[j];
        } else {
          std::memcpy(yr, ar, cols * sizeof(float));
        }
      }
    }
  });
}

#if defined(DS4_ISA_AVX512) || defined(DS4_ISA_AMX)
// 16 scales (or minimums) as float32; float16 ones widened by F16C, exactly.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The 16 (input pair, column) bfloat16 operand vectors of one column group over one input
// group: w[p] holds, for each of the 16 columns, q at inputs 2p and 2p + 1.
// With fifth bits, code = nibble + 16 * bit indexes the table's 32 entries (0..31); with
// levels, a nibble indexes them.
struct NibbleWidener {
  __m512i lut, low4, sixteen;
  explicit NibbleWidener(const float* levels = nullptr) {
    // bfloat16 of each code's value: 0..31, or the given levels; exact, small integers fit bfloat16.
    alignas(64) uint16_t table[32] = {};
    for (int i = 0; i < 32; ++i) {
      const float v = levels == nullptr ? static_cast<float>(i) : i < 16 ? levels[i] : 0.0f;
      table[i] = static_cast<uint16_t>(bf16_bits(v) >> 16);
    }
    lut = _mm512_load_si512(table);
    low4 = _mm512_set1_epi16(0x0F);
    sixteen = _mm512_set1_epi16(16);
  }
  inline void widen(const uint8_t* q, __m512bh w[16]) const {
    for (int c = 0; c < 8; ++c) {
      __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32)));
      w[c] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, low4), lut);
      w[c + 8] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), lut);
    }
  }
  // The same with each code's fifth bit from `high` (16 masks of 32 bits, one per input pair).
  inline void widen(const uint8_t* q, const uint32_t* high, __m512bh w[16]) const {
    for (int c = 0; c < 8; ++c) {
      __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32)));
      const __m512i lo = _mm512_and_si512(bytes, low4), hi = _mm512_srli_epi16(bytes, 4);
      w[c] = (__m512bh)_mm512_permutexvar_epi16(_mm512_mask_add_epi16(lo, _cvtu32_mask32(high[c]), lo, sixteen), lut);
      w[c + 8] =
          (__m512bh)_mm512_permutexvar_epi16(_mm512_mask_add_epi16(hi, _cvtu32_mask32(high[c + 8]), hi, sixteen), lut);
    }
  }
};
#endif

#if defined(DS4_ISA_AVX512)
template <typename S>
void int4_linear_with(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const Output& out,
                      const Codes& codes) {
  const int64_t K = x.size(1), M = x.size(0), KB = packed.size(1);
  const NibbleWidener widener(codes.levels);
  const uint8_t* q0 = packed.data_ptr<uint8_t>();
  vector_op<uint16_t, S>(x, packed, scales, out, [&](const uint8_t* q, const S* sc, int64_t,
                                                       const RoundedRows<uint16_t>& xr, int64_t b, float* acc_y) {
    __m512bh w[16];
    if (codes.high == nullptr) {
      widener.widen(q, w);
    } else {
      widener.widen(q, codes.high + (q - q0) / 256 * 16, w);
    }
    const __m512 scale = load16(sc), minimum = load16(sc + C);
    for (int64_t r = 0; r < M; ++r) {
      const uint32_t* xp = reinterpret_cast<const uint32_t*>(xr.values.data() + r * K + b * G);
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int t = 0; t < 16; t += 4) {
        a0 = _mm512_dpbf16_ps(a0, w[t], (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[t])));
        a1 = _mm512_dpbf16_ps(a1, w[t + 1], (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[t + 1])));
        a2 = _mm512_dpbf16_ps(a2, w[t + 2], (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[t + 2])));
        a3 = _mm512_dpbf16_ps(a3, w[t + 3], (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[t + 3])));
      }
      const __m512 dot = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
      float* yr = acc_y + r * C;
      __m512 acc = _mm512_fmadd_ps(scale, dot, _mm512_loadu_ps(yr));
      _mm512_storeu_ps(yr, _mm512_fmadd_ps(minimum, _mm512_set1_ps(xr.sums[r * KB + b]), acc));
    }
  });
}

#endif  // DS4_ISA_AVX512

#if defined(DS4_ISA_AVX2)
// One column group's 32 x 16 nibbles as float32, w[k * 16 + j] for input k and column j.  In
// the packed layout a 16-byte half of a chunk holds 8 columns' (even, odd) input pairs, so
// widening its 16-bit words to 32 bits gives each column's pair in one lane.
inline void widen_group(const uint8_t* q, float* w) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i low8 = _mm256_set1_epi32(0xFF);
  for (int c = 0; c < 8; ++c) {
    for (int h = 0; h < 2; ++h) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * 32 + h * 16));
      const __m128i nibbles[2] = {_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4)};
      for (int s = 0; s < 2; ++s) {  // s = 0: pair c, s = 1: pair c + 8
        const __m256i pairs = _mm256_cvtepu16_epi32(nibbles[s]);
        float* dst = w + 2 * (c + 8 * s) * C + 8 * h;
        _mm256_store_ps(dst, _mm256_cvtepi32_ps(_mm256_and_si256(pairs, low8)));
        _mm256_store_ps(dst + C, _mm256_cvtepi32_ps(_mm256_srli_epi32(pairs, 8)));
      }
    }
  }
}

// 8 scales (or minimums) as float32; float16 ones widened by F16C, exactly.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// y += scale * dot + minimum * sum for one row's 16 outputs, from the 4 x 2 accumulators.
template <typename S>
inline void finish_group(__m256 a[4][2], const S* sc, float sum, float* yr) {
  const __m256 s = _mm256_set1_ps(sum);
  for (int h = 0; h < 2; ++h) {
    const __m256 dot = _mm256_add_ps(_mm256_add_ps(a[0][h], a[1][h]), _mm256_add_ps(a[2][h], a[3][h]));
    const __m256 acc = _mm256_fmadd_ps(load8(sc + 8 * h), dot, _mm256_loadu_ps(yr + 8 * h));
    _mm256_storeu_ps(yr + 8 * h, _mm256_fmadd_ps(load8(sc + C + 8 * h), s, acc));
  }
}

// One row (decoding): each chunk's nibbles are converted in registers and used at once, with
// no shifts.  A 16-byte half of a chunk widened to 32-bit lanes holds one 16-bit word per
// column: bits 0-3 the even input of pair c, 4-7 the even input of pair c + 8, 8-11 and 12-15
// the odd inputs of the same pairs.  Masked in place, a nibble converts to q * 2^(4i) for its
// position i; the row's inputs come divided by that power of two (`scaled_row`), so every
// product equals x * q exactly and the sums, in the contract's order, are the other ops'
// bits.  The low nibbles (pairs 0..7) are all taken before the high ones (pairs 8..15), so
// that each accumulator sees its pairs in the order of the contract.
template <typename S>
inline void group_one_row(const uint8_t* q, const float* xs, const S* sc, float sum, float* yr) {
  const __m256i even_mask[2] = {_mm256_set1_epi32(0x000F), _mm256_set1_epi32(0x00F0)};
  const __m256i odd_mask[2] = {_mm256_set1_epi32(0x0F00), _mm256_set1_epi32(0xF000)};
  __m256 a[4][2];
  for (auto& ah : a) ah[0] = ah[1] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int s = 0; s < 2; ++s) {
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const int p = c + 8 * s;
      const __m256 odd = _mm256_broadcast_ss(xs + 2 * p + 1), even = _mm256_broadcast_ss(xs + 2 * p);
      for (int h = 0; h < 2; ++h) {
        const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * 32 + h * 16)));
        const __m256 qe = _mm256_cvtepi32_ps(_mm256_and_si256(words, even_mask[s]));
        const __m256 qo = _mm256_cvtepi32_ps(_mm256_and_si256(words, odd_mask[s]));
        a[c & 3][h] = _mm256_fmadd_ps(odd, qo, a[c & 3][h]);
        a[c & 3][h] = _mm256_fmadd_ps(even, qe, a[c & 3][h]);
      }
    }
  }
  finish_group(a, sc, sum, yr);
}

// One row rounded to bfloat16, each input divided by the weight its nibble carries in
// group_one_row (2^0, 2^-8, 2^-4, 2^-12 for even and odd inputs of a group's first and second
// halves).  Exact: a bfloat16 normal times 2^-12 still has all its bits in float32's range,
// and subnormals were already rounded to zero.
inline std::vector<float> scaled_row(const float* x, int64_t K) {
  static constexpr float kWeight[4] = {1.0f, 0x1p-8f, 0x1p-4f, 0x1p-12f};  // by (second half, odd)
  std::vector<float> out(K);
  for (int64_t k = 0; k < K; ++k) out[k] = bits_float(bf16_bits(x[k])) * kWeight[2 * ((k & (G - 1)) >= 16) + (k & 1)];
  return out;
}

// Accumulators K0 and K0 + 1 of a row's 32 outputs over one input group, for two column
// groups' widened weights wa and wb: a[c][v] takes, for the columns of vector v (8 each, wa's
// then wb's), input pairs p = K0 + c, K0 + c + 4, ..., odd input first, as the contract orders.
template <int K0>
inline void two_accumulators(const float* wa, const float* wb, const float* xv, __m256 a[2][4]) {
  for (int c = 0; c < 2; ++c)
    for (int v = 0; v < 4; ++v) a[c][v] = _mm256_setzero_ps();
#pragma GCC unroll 16  // fully: the accumulators stay in registers
  for (int t = 0; t < 16; ++t) {
    const int p = K0 + ((t >> 1) & 1) + 4 * (t >> 2), i = (t & 1) ? 2 * p : 2 * p + 1;
    const __m256 xb = _mm256_broadcast_ss(xv + i);
    __m256* ac = a[p & 1];
    ac[0] = _mm256_fmadd_ps(xb, _mm256_load_ps(wa + i * C), ac[0]);
    ac[1] = _mm256_fmadd_ps(xb, _mm256_load_ps(wa + i * C + 8), ac[1]);
    ac[2] = _mm256_fmadd_ps(xb, _mm256_load_ps(wb + i * C), ac[2]);
    ac[3] = _mm256_fmadd_ps(xb, _mm256_load_ps(wb + i * C + 8), ac[3]);
  }
}

// One row of a column pair: y += scale * dot + minimum * sum for its 32 outputs (wa's 16, then
// wb's), with the additions of finish_group in its order.  A row's 32 outputs need 16
// accumulators, all of AVX2's registers; taken two at a time (0 and 1, summed, then 2 and 3),
// they leave room for the operands, and each input is broadcast once for 32 columns instead
// of 16: on the CPUs measured, the broadcasts bounded the 16-column loop, not the multiply-adds.
template <typename S>
inline void column_pair_row(const float* wa, const float* wb, const float* xv, const S* sa, const S* sb, float sum,
                            float* yr) {
  __m256 a[2][4], low[4];
  two_accumulators<0>(wa, wb, xv, a);
  for (int v = 0; v < 4; ++v) low[v] = _mm256_add_ps(a[0][v], a[1][v]);
  two_accumulators<2>(wa, wb, xv, a);
  const __m256 s = _mm256_set1_ps(sum);
  for (int v = 0; v < 4; ++v) {
    const S* sc = (v < 2 ? sa : sb) + 8 * (v & 1);
    const __m256 dot = _mm256_add_ps(low[v], _mm256_add_ps(a[0][v], a[1][v]));
    const __m256 acc = _mm256_fmadd_ps(load8(sc), dot, _mm256_loadu_ps(yr + 8 * v));
    _mm256_storeu_ps(yr + 8 * v, _mm256_fmadd_ps(load8(sc + C), s, acc));
  }
}

// From this many rows on, several rows take column groups in pairs (column_pair_row).  Below it
// the op is bound by streaming the weights from memory, which the pair's two streams, KB * 256
// bytes apart, slowed (measured: 2 rows 0.67x, 8 rows 0.88x, 16 rows 1.01x, 32 rows 1.12x); a
// pair version of group_one_row measured 0.63x for one decoding row, so that one stays alone.
constexpr int64_t PAIR_ROWS = 16;

template <typename S>
void int4_linear_with(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const Output& out,
                      const Codes& codes) {
  TORCH_CHECK(codes.plain(), "int4_linear_" DS4_ISA ": fifth bits and levels are compiled for avx512 only");
  const int64_t K = x.size(1), M = x.size(0), KB = packed.size(1);
  if (M == 1) {
    const std::vector<float> xs = scaled_row(x.data_ptr<float>(), K);
    vector_op<float, S>(x, packed, scales, out, [&](const uint8_t* q, const S* sc, int64_t,
                                                    const RoundedRows<float>& xr, int64_t b, float* acc_y) {
      group_one_row(q, xs.data() + b * G, sc, xr.sums[b], acc_y);
    });
    return;
  }
  // Several rows: each column group's weights widened once into a buffer that every row reads.
  auto rows_of_group = [&](const float* w, const S* sc, const RoundedRows<float>& xr, int64_t b, float* acc_y,
                           int64_t stride) {
    for (int64_t r = 0; r < M; ++r) {
      const float* xv = xr.values.data() + r * K + b * G;
      __m256 a[4][2];
      for (auto& ah : a) ah[0] = ah[1] = _mm256_setzero_ps();
#pragma GCC unroll 16  // fully: the accumulators stay in registers
      for (int p = 0; p < 16; ++p) {
        const __m256 odd = _mm256_broadcast_ss(xv + 2 * p + 1), even = _mm256_broadcast_ss(xv + 2 * p);
        for (int h = 0; h < 2; ++h) {
          a[p & 3][h] = _mm256_fmadd_ps(odd, _mm256_load_ps(w + (2 * p + 1) * C + 8 * h), a[p & 3][h]);
          a[p & 3][h] = _mm256_fmadd_ps(even, _mm256_load_ps(w + 2 * p * C + 8 * h), a[p & 3][h]);
        }
      }
      finish_group(a, sc, xr.sums[r * KB + b], acc_y + r * stride);
    }
  };
  if (M < PAIR_ROWS) {
    vector_op<float, S>(x, packed, scales, out, [&](const uint8_t* q, const S* sc, int64_t,
                                                    const RoundedRows<float>& xr, int64_t b, float* acc_y) {
      alignas(32) float w[G * C];
      widen_group(q, w);
      rows_of_group(w, sc, xr, b, acc_y, C);
    });
    return;
  }
  // Two column groups at a time (a lone last group alone, 16 columns a row).
  vector_op<float, S, 2>(x, packed, scales, out, [&](const uint8_t* q, const S* sc, int64_t n,
                                                      const RoundedRows<float>& xr, int64_t b, float* acc_y) {
    alignas(32) float w[2][G * C];
    widen_group(q, w[0]);
    if (n == 1) {
      rows_of_group(w[0], sc, xr, b, acc_y, 2 * C);
      return;
    }
    widen_group(q + KB * 256, w[1]);
    for (int64_t r = 0; r < M; ++r)
      column_pair_row(w[0], w[1], xr.values.data() + r * K + b * G, sc, sc + KB * 2 * C, xr.sums[r * KB + b],
                      acc_y + r * 2 * C);
  });
}

#endif  // DS4_ISA_AVX2

#if !defined(DS4_ISA_AVX512) && !defined(DS4_ISA_AMX) && !defined(DS4_ISA_AVX2)
// The compiler's generic vectors of 16 floats: it lowers them to the target's own registers
// (NEON on aarch64, SSE2 on a bare x86-64) and fuses a * b + c where the target has fused
// multiply-adds (GCC's default -ffp-contract=fast), as the other ops do.
typedef float vf __attribute__((vector_size(C * sizeof(float))));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 float16 scales (or minimums) widened one by one: the target may have no conversion
// instruction, and c10's is exact.
inline vf loadv(const uint16_t* p) {
  float f[C];
  for (int j = 0; j < C; ++j) f[j] = static_cast<float>(c10::Half(p[j], c10::Half::from_bits()));
  return loadv(f);
}

// Same layout and meaning as the AVX2 op's widen_group, in plain loops the compiler
// vectorises (its generic vector conversions would convert lane by lane).
inline void widen_group(const uint8_t* q, float* w) {
  for (int c = 0; c < 8; ++c)
    for (int s = 0; s < 2; ++s)
      for (int e = 0; e < 2; ++e) {
        float* dst = w + (2 * (c + 8 * s) + e) * C;
        for (int j = 0; j < C; ++j) dst[j] = static_cast<float>((q[c * 32 + 2 * j + e] >> (4 * s)) & 0x0F);
      }
}

template <typename S>
void int4_linear_with(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const Output& out,
                      const Codes& codes) {
  TORCH_CHECK(codes.plain(), "int4_linear_" DS4_ISA ": fifth bits and levels are compiled for avx512 only");
  const int64_t K = x.size(1), M = x.size(0), KB = packed.size(1);
  vector_op<float, S>(x, packed, scales, out, [&](const uint8_t* q, const S* sc, int64_t,
                                                    const RoundedRows<float>& xr, int64_t b, float* acc_y) {
    alignas(64) float w[G * C];
    widen_group(q, w);
    const vf scale = loadv(sc), minimum = loadv(sc + C);
    for (int64_t r = 0; r < M; ++r) {
      const float* xv = xr.values.data() + r * K + b * G;
      vf a[4] = {};
#pragma GCC unroll 16  // fully: the accumulators stay in registers
      for (int p = 0; p < 16; ++p) {
        a[p & 3] += xv[2 * p + 1] * loadv(w + (2 * p + 1) * C);
        a[p & 3] += xv[2 * p] * loadv(w + 2 * p * C);
      }
      const vf dot = (a[0] + a[1]) + (a[2] + a[3]);
      float* yr = acc_y + r * C;
      vf acc = scale * dot + loadv(yr);
      acc = minimum * xr.sums[r * KB + b] + acc;
      std::memcpy(yr, &acc, sizeof acc);
    }
  });
}

#endif  // the portable op

#if !defined(DS4_ISA_AMX)
// The vector ops' entry points, over the one `int4_linear_with` this build defines above.
DS4_ENTRY at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                  const c10::optional<at::Tensor>& high, const c10::optional<at::Tensor>& levels) {
  check_arguments(x, packed, scales);
  const Codes codes = check_codes(packed, high, levels);
  const int64_t N = packed.size(0) * C;
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  const Output out{y.data_ptr<float>(), N, N, false};
  with_scale_type(scales, [&](auto s) { int4_linear_with<decltype(s)>(x, packed, scales, out, codes); });
  return y;
}

DS4_ENTRY void int4_linear_add(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, at::Tensor out,
                               const c10::optional<at::Tensor>& high, const c10::optional<at::Tensor>& levels) {
  check_arguments(x, packed, scales);
  const Codes codes = check_codes(packed, high, levels);
  const int64_t N = packed.size(0) * C;
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) <= N && out.size(1) > N - C,
              "int4_linear_add: out must be float32 [", x.size(0), ", ", N - C + 1, "..", N, "] with contiguous rows");
  const Output into{out.data_ptr<float>(), out.stride(0), out.size(1), true};
  with_scale_type(scales, [&](auto s) { int4_linear_with<decltype(s)>(x, packed, scales, into, codes); });
}
#endif

#if defined(DS4_ISA_AMX)
constexpr int64_t TR = 16;  // rows per tile
constexpr int64_t GB = 8;   // column groups per block (128 output columns)

// Linux grants the tile registers' state per process, on request.
bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Palette 1, two sets of three tiles, for two input groups in flight: tiles 0 and 3 take a
// group's products (16 rows x 16 float32), 1 and 4 hold 16 rows of x over the group (32
// bfloat16), 2 and 5 the group's weights as 16 input pairs x 16 columns.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 6; ++t) {
      colsb[t] = 64;
      rows[t] = TR;
    }
  }
};

// acc[r] += scale * dots[r] + minimum * sums[r * stride], for the 16 rows of a tile.
template <typename S>
inline void scale_group(__m512 acc[TR], const float* dots, const S* sc, const float* sums, int64_t stride) {
  const __m512 scale = load16(sc), minimum = load16(sc + C);
  for (int r = 0; r < TR; ++r) {
    acc[r] = _mm512_fmadd_ps(scale, _mm512_load_ps(dots + r * C), acc[r]);
    acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sums[r * stride]), acc[r]);
  }
}

template <typename S>
at::Tensor int4_linear_with(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), NG = packed.size(0), KB = packed.size(1);
  at::Tensor y = at::empty({M, NG * C}, x.options());
  if (M == 0) return y;
  const int64_t MT = (M + TR - 1) / TR;  // row tiles; the last one padded with zero rows
  const RoundedRows<uint16_t> xr = round_rows<uint16_t>(x, MT * TR, TR);
  const NibbleWidener widener;
  const TileConfig config;

  const uint8_t* q0 = packed.data_ptr<uint8_t>();
  const S* s0 = static_cast<const S*>(scales.const_data_ptr());
  float* y0 = y.data_ptr<float>();
  at::parallel_for(0, NG, GB, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&config);
    // A block of column groups' weights over all input groups, as tiles: widened once, used
    // by every row tile.  Blocking columns keeps a row tile's x in L1 across the block and
    // writes each output row in runs of GB * 16 values.
    std::vector<__m512bh> wt(GB * KB * 16);
    alignas(64) float dots[2][TR * C];
    for (int64_t g0 = begin; g0 < end; g0 += GB) {
      const int64_t g1 = std::min(end, g0 + GB);
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < KB; ++b) widener.widen(q0 + (g * KB + b) * 256, wt.data() + ((g - g0) * KB + b) * 16);
      for (int64_t mt = 0; mt < MT; ++mt) {
        const uint16_t* xt = xr.values.data() + mt * TR * K;  // this row tile's groups, 1 KB each
        const float* st = xr.sums.data() + mt * TR * KB;
        const int64_t valid = std::min<int64_t>(TR, M - mt * TR);
        for (int64_t g = g0; g < g1; ++g) {
          const __m512bh* wg = wt.data() + (g - g0) * KB * 16;
          const S* sg = s0 + g * KB * 2 * C;
          __m512 acc[TR];
          for (int r = 0; r < TR; ++r) acc[r] = _mm512_setzero_ps();
          // Groups in order (the sums' order is part of the contract), software-pipelined on
          // two tile sets: group b + 1's products are computed and stored while group b's
          // are scaled, so the vector loads do not wait on the tile store just issued.
          auto products = [&](int64_t b) {
            if ((b & 1) == 0) {
              _tile_zero(0);
              _tile_loadd(1, xt + b * TR * G, 64);
              _tile_loadd(2, wg + b * 16, 64);
              _tile_dpbf16ps(0, 1, 2);
              _tile_stored(0, dots[0], C * sizeof(float));
            } else {
              _tile_zero(3);
              _tile_loadd(4, xt + b * TR * G, 64);
              _tile_loadd(5, wg + b * 16, 64);
              _tile_dpbf16ps(3, 4, 5);
              _tile_stored(3, dots[1], C * sizeof(float));
            }
          };
          products(0);
          for (int64_t b = 0; b < KB; ++b) {
            if (b + 1 < KB) products(b + 1);
            scale_group(acc, dots[b & 1], sg + b * 2 * C, st + b, KB);
          }
          for (int64_t r = 0; r < valid; ++r) _mm512_storeu_ps(y0 + (mt * TR + r) * NG * C + g * C, acc[r]);
        }
      }
    }
    _tile_release();
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  check_arguments(x, packed, scales);
  TORCH_CHECK(tiles_permitted(), "int4_linear_amx: the kernel refused the AMX tile state (arch_prctl)");
  return with_scale_type(scales, [&](auto s) { return int4_linear_with<decltype(s)>(x, packed, scales); });
}
#endif  // DS4_ISA_AMX

}  // namespace int4
}  // namespace

TORCH_LIBRARY_FRAGMENT(ds4, m) {
#if defined(DS4_ISA_AMX)
  m.def(DS4_OP("int4_linear") "(Tensor x, Tensor packed, Tensor scales) -> Tensor");
#else
  m.def(DS4_OP("int4_linear") "(Tensor x, Tensor packed, Tensor scales, Tensor? high=None, Tensor? levels=None) -> Tensor");
  m.def(DS4_OP("int4_linear_add") "(Tensor x, Tensor packed, Tensor scales, Tensor(a!) out, Tensor? high=None, "
                                  "Tensor? levels=None) -> ()");
#endif
}

TORCH_LIBRARY_IMPL(ds4, CPU, m) {
  m.impl(DS4_OP("int4_linear"), &int4::int4_linear);
#if !defined(DS4_ISA_AMX)
  m.impl(DS4_OP("int4_linear_add"), &int4::int4_linear_add);
#endif
}
