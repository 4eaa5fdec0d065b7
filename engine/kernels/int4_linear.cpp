// 4-bit grouped matmul on CPU with bfloat16 dot products (AVX512-BF16).
//
// ds4::int4_linear(x, packed, scales) -> y
//   x       [M, K] float32, rows may be strided, each row contiguous; rounded to bfloat16
//           (nearest even) on entry, as torch's own int4 kernels take it
//   packed  uint8 [N / 16, K / 32, 8, 32]: the 4-bit values q of 16 output columns over one
//           group of 32 inputs (layout: see int4_pack in engine/weights.py)
//   scales  float32 [N / 16, K / 32, 2, 16]: per column and group, scale and minimum, so that
//           w = q * scale + minimum
//   y       [M, N] float32 = x @ w.T
// Q4_0, Q4_1 and Q4_K all have this form; scales stay float32, more exact than the bfloat16
// scales of torch's int4 kernels.
//
// Per group, one bfloat16 dot product of x with q (exact products, float32 sums in a fixed
// order of four interleaved accumulators) and two fused multiply-adds: y += scale * (x . q) +
// minimum * sum(x).  A row's result depends on that row alone, in one fixed order of
// operations: the same whatever the number of rows (one decoding row or a prefill chunk),
// the other rows and the thread count.  Work is split over groups of 16 output columns.
// Built only where the compiler targets AVX512-BF16; elsewhere the op does not exist and the
// engine keeps torch's kernel.  It does not add biases or handle K not divisible by 32.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t G = 32;  // inputs per group
constexpr int64_t C = 16;  // output columns per zmm

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "int4_linear: x must be [M, K] float32 with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == 8 && packed.size(3) == 32,
              "int4_linear: packed must be contiguous uint8 [N/16, K/32, 8, 32]");
  const int64_t M = x.size(0), K = x.size(1), NG = packed.size(0), KB = packed.size(1);
  TORCH_CHECK(K == KB * G, "int4_linear: x has ", K, " inputs, the weights ", KB * G);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == NG && scales.size(1) == KB && scales.size(2) == 2 && scales.size(3) == C,
              "int4_linear: scales must be contiguous float32 [N/16, K/32, 2, 16]");
  at::Tensor y = at::empty({M, NG * C}, x.options());
  if (M == 0) return y;

  // x in bfloat16 pairs, and each row's per-group sums of those bfloat16 values.
  std::vector<uint32_t> xb(M * K / 2);
  std::vector<float> xs(M * KB);
  const float* x0 = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    const float* row = x0 + r * x.stride(0);
    for (int64_t b = 0; b < KB; ++b) {
      __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + b * G + 16), _mm512_loadu_ps(row + b * G));
      _mm512_storeu_si512(xb.data() + (r * K + b * G) / 2, (__m512i)lo);
      // The group's sum, of the rounded values, in a fixed order.
      __m512 a = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)lo));
      __m512 c = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)lo, 1));
      xs[r * KB + b] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
    }
  }

  // bfloat16 of 0..15, indexed by a nibble.
  alignas(64) uint16_t table[32] = {};
  for (int i = 0; i < 16; ++i) {
    float f = static_cast<float>(i);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    table[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers fit bfloat16
  }
  const __m512i lut = _mm512_load_si512(table);
  const __m512i low4 = _mm512_set1_epi16(0x0F);

  const uint8_t* q0 = packed.data_ptr<uint8_t>();
  const float* s0 = scales.data_ptr<float>();
  float* y0 = y.data_ptr<float>();
  at::parallel_for(0, NG, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc_y(M * C);  // each row's 16 running outputs
    for (int64_t g = begin; g < end; ++g) {
      std::fill(acc_y.begin(), acc_y.end(), 0.0f);
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* q = q0 + (g * KB + b) * 256;
        __m512bh w[16];
        for (int c = 0; c < 8; ++c) {
          __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32)));
          w[c] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, low4), lut);
          w[c + 8] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), lut);
        }
        const float* sc = s0 + (g * KB + b) * 2 * C;
        const __m512 scale = _mm512_loadu_ps(sc), minimum = _mm512_loadu_ps(sc + C);
        for (int64_t r = 0; r < M; ++r) {
          const uint32_t* xp = xb.data() + (r * K + b * G) / 2;
          __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (int t = 0; t < 16; t += 4) {
            a0 = _mm512_dpbf16_ps(a0, w[t], (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[t])));
            a1 = _mm512_dpbf16_ps(a1, w[t + 1], (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[t + 1])));
            a2 = _mm512_dpbf16_ps(a2, w[t + 2], (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[t + 2])));
            a3 = _mm512_dpbf16_ps(a3, w[t + 3], (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[t + 3])));
          }
          const __m512 dot = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
          float* yr = acc_y.data() + r * C;
          __m512 acc = _mm512_fmadd_ps(scale, dot, _mm512_loadu_ps(yr));
          _mm512_storeu_ps(yr, _mm512_fmadd_ps(minimum, _mm512_set1_ps(xs[r * KB + b]), acc));
        }
      }
      for (int64_t r = 0; r < M; ++r) std::memcpy(y0 + r * NG * C + g * C, acc_y.data() + r * C, C * sizeof(float));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ds4, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(ds4, CPU, m) {
  m.impl("int4_linear", &int4_linear);
}

#endif
