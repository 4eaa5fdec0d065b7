// 4-bit grouped matmul on CPU with bfloat16 dot products: AVX512-BF16 vectors, and AMX tiles
// for many rows.
//
// ds4::int4_linear(x, packed, scales) -> y          (AVX512-BF16)
// ds4::int4_linear_tiles(x, packed, scales) -> y    (AMX-BF16; same contract)
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
// Per group, one bfloat16 dot product of x with q (exact products, float32 sums) and two fused
// multiply-adds: y += scale * (x . q) + minimum * sum(x).  A row's result depends on that row
// alone, in one fixed order of operations per op: the same whatever the number of rows (one
// decoding row or a prefill chunk), the other rows and the thread count.  The two ops sum a
// group's 32 products in different orders (four interleaved accumulators; the tile unit's
// own order), so their results can differ in the last bits of a group's dot product.
//
// The vector op spends most of its time on the products of few rows: it is the one for
// decoding.  The tile op multiplies 16 rows by 16 columns over a group in one instruction, and
// only the per-group scaling runs on vectors; it needs rows to fill its tiles (prefill chunks,
// wide batches).  Work is split over groups of 16 output columns in both.  Each op is built
// only where the compiler targets its instructions; elsewhere it does not exist and the engine
// keeps another path.  The tile op asks the kernel for permission to use the tile registers
// (Linux arch_prctl) and raises if that is refused.  Neither adds biases or handles K not
// divisible by 32.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define DS4_HAVE_AMX 1
#endif

namespace {

constexpr int64_t G = 32;  // inputs per group
constexpr int64_t C = 16;  // output columns per zmm

void check_arguments(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "int4_linear: x must be [M, K] float32 with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == 8 && packed.size(3) == 32,
              "int4_linear: packed must be contiguous uint8 [N/16, K/32, 8, 32]");
  const int64_t K = x.size(1), NG = packed.size(0), KB = packed.size(1);
  TORCH_CHECK(K == KB * G, "int4_linear: x has ", K, " inputs, the weights ", KB * G);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == NG && scales.size(1) == KB && scales.size(2) == 2 && scales.size(3) == C,
              "int4_linear: scales must be contiguous float32 [N/16, K/32, 2, 16]");
}

// x rounded to bfloat16 (pairs packed in 32 bits), and each row's per-group sums of those
// rounded values in a fixed order ([rows, K / 32]).  The pairs are laid out by rows ([rows,
// K / 2]) or, with `tile_rows`, by tiles: for each block of tile_rows rows and each group, the
// block's rows over that group, contiguous (so a row tile's groups stream in order).  Rows
// from M to `rows` (padding) are zero.
struct RoundedRows {
  std::vector<uint32_t> pairs;
  std::vector<float> sums;
};

RoundedRows round_rows(const at::Tensor& x, int64_t rows, int64_t tile_rows = 0) {
  const int64_t M = x.size(0), K = x.size(1), KB = K / G;
  RoundedRows out{std::vector<uint32_t>(rows * K / 2, 0u), std::vector<float>(rows * KB, 0.0f)};
  const float* x0 = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    const float* row = x0 + r * x.stride(0);
    for (int64_t b = 0; b < KB; ++b) {
      __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + b * G + 16), _mm512_loadu_ps(row + b * G));
      const int64_t at = tile_rows ? ((r / tile_rows) * KB + b) * tile_rows * G / 2 + (r % tile_rows) * G / 2
                                   : (r * K + b * G) / 2;
      _mm512_storeu_si512(out.pairs.data() + at, (__m512i)lo);
      __m512 a = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)lo));
      __m512 c = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)lo, 1));
      out.sums[r * KB + b] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
    }
  }
  return out;
}

// The 16 (input pair, column) bfloat16 operand vectors of one column group over one input
// group: w[p] holds, for each of the 16 columns, q at inputs 2p and 2p + 1.
struct NibbleWidener {
  __m512i lut, low4;
  NibbleWidener() {
    // bfloat16 of 0..15, indexed by a nibble; exact, small integers fit bfloat16.
    alignas(64) uint16_t table[32] = {};
    for (int i = 0; i < 16; ++i) {
      float f = static_cast<float>(i);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      table[i] = static_cast<uint16_t>(bits >> 16);
    }
    lut = _mm512_load_si512(table);
    low4 = _mm512_set1_epi16(0x0F);
  }
  inline void widen(const uint8_t* q, __m512bh w[16]) const {
    for (int c = 0; c < 8; ++c) {
      __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32)));
      w[c] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, low4), lut);
      w[c + 8] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), lut);
    }
  }
};

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  check_arguments(x, packed, scales);
  const int64_t M = x.size(0), K = x.size(1), NG = packed.size(0), KB = packed.size(1);
  at::Tensor y = at::empty({M, NG * C}, x.options());
  if (M == 0) return y;
  const RoundedRows xr = round_rows(x, M);
  const NibbleWidener widener;

  const uint8_t* q0 = packed.data_ptr<uint8_t>();
  const float* s0 = scales.data_ptr<float>();
  float* y0 = y.data_ptr<float>();
  at::parallel_for(0, NG, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc_y(M * C);  // each row's 16 running outputs
    for (int64_t g = begin; g < end; ++g) {
      std::fill(acc_y.begin(), acc_y.end(), 0.0f);
      for (int64_t b = 0; b < KB; ++b) {
        __m512bh w[16];
        widener.widen(q0 + (g * KB + b) * 256, w);
        const float* sc = s0 + (g * KB + b) * 2 * C;
        const __m512 scale = _mm512_loadu_ps(sc), minimum = _mm512_loadu_ps(sc + C);
        for (int64_t r = 0; r < M; ++r) {
          const uint32_t* xp = xr.pairs.data() + (r * K + b * G) / 2;
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
          _mm512_storeu_ps(yr, _mm512_fmadd_ps(minimum, _mm512_set1_ps(xr.sums[r * KB + b]), acc));
        }
      }
      for (int64_t r = 0; r < M; ++r) std::memcpy(y0 + r * NG * C + g * C, acc_y.data() + r * C, C * sizeof(float));
    }
  });
  return y;
}

#ifdef DS4_HAVE_AMX
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
inline void scale_group(__m512 acc[TR], const float* dots, const float* sc, const float* sums, int64_t stride) {
  const __m512 scale = _mm512_loadu_ps(sc), minimum = _mm512_loadu_ps(sc + C);
  for (int r = 0; r < TR; ++r) {
    acc[r] = _mm512_fmadd_ps(scale, _mm512_load_ps(dots + r * C), acc[r]);
    acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sums[r * stride]), acc[r]);
  }
}

at::Tensor int4_linear_tiles(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  check_arguments(x, packed, scales);
  TORCH_CHECK(tiles_permitted(), "int4_linear_tiles: the kernel refused the AMX tile state (arch_prctl)");
  const int64_t M = x.size(0), K = x.size(1), NG = packed.size(0), KB = packed.size(1);
  at::Tensor y = at::empty({M, NG * C}, x.options());
  if (M == 0) return y;
  const int64_t MT = (M + TR - 1) / TR;  // row tiles; the last one padded with zero rows
  const RoundedRows xr = round_rows(x, MT * TR, TR);
  const NibbleWidener widener;
  const TileConfig config;

  const uint8_t* q0 = packed.data_ptr<uint8_t>();
  const float* s0 = scales.data_ptr<float>();
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
        const uint32_t* xt = xr.pairs.data() + mt * TR * K / 2;  // this row tile's groups, 1 KB each
        const float* st = xr.sums.data() + mt * TR * KB;
        const int64_t valid = std::min<int64_t>(TR, M - mt * TR);
        for (int64_t g = g0; g < g1; ++g) {
          const __m512bh* wg = wt.data() + (g - g0) * KB * 16;
          const float* sg = s0 + g * KB * 2 * C;
          __m512 acc[TR];
          for (int r = 0; r < TR; ++r) acc[r] = _mm512_setzero_ps();
          // Groups in order (the sums' order is part of the contract), software-pipelined on
          // two tile sets: group b + 1's products are computed and stored while group b's
          // are scaled, so the vector loads do not wait on the tile store just issued.
          auto products = [&](int64_t b) {
            if ((b & 1) == 0) {
              _tile_zero(0);
              _tile_loadd(1, xt + b * TR * G / 2, 64);
              _tile_loadd(2, wg + b * 16, 64);
              _tile_dpbf16ps(0, 1, 2);
              _tile_stored(0, dots[0], C * sizeof(float));
            } else {
              _tile_zero(3);
              _tile_loadd(4, xt + b * TR * G / 2, 64);
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
#endif  // DS4_HAVE_AMX

}  // namespace

TORCH_LIBRARY_FRAGMENT(ds4, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales) -> Tensor");
#ifdef DS4_HAVE_AMX
  m.def("int4_linear_tiles(Tensor x, Tensor packed, Tensor scales) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(ds4, CPU, m) {
  m.impl("int4_linear", &int4_linear);
#ifdef DS4_HAVE_AMX
  m.impl("int4_linear_tiles", &int4_linear_tiles);
#endif
}

#endif
