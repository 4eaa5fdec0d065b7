// GGUF blocks straight into the layouts of the engine's CPU matmul kernels, at load.
//
// ds4::repack_int4_<isa>(raws, qtypes, order, pad_to) -> (packed, scales)
//   raws    one uint8 tensor [rows_i, row_bytes_i] per GGUF matrix (Q4_0 = 2, Q4_1 = 3,
//           Q4_K = 12 in `qtypes`), all of the same width K; read as rows of one matrix, the
//           concatenation of the raws
//   order   int64 [N]: output row n is row order[n] of that concatenation
//   packed  uint8 [P / 16, K / 32, 8, 32] and scales [P / 16, K / 32, 2, 16]: exactly
//           engine.weights.int4_pack of the rows' (q, scale, minimum) as engine.quants unpacks
//           them, P = N rounded up to `pad_to` (a multiple of 16; the padding rows are zero).
//           The scales are float16 when every one of them is exactly a float16 (Q4_0 and Q4_1,
//           whose fields are float16, unless -8 * d overflows), else float32 (Q4_K in general,
//           whose scales are products); the int4 kernels give the same bits with either.
// ds4::repack_codes_<isa>(raws, qtypes, order, K, pad_to) -> (packed, scales, high)
//   the same for the coded types as well (Q5_0 = 6, Q5_1 = 7, Q5_K = 13, IQ4_NL = 20,
//           IQ4_XS = 23, mixed with the three above): their codes' low 4 bits in `packed`, the
//           fifth bits in `high` uint8 [P / 16, K / 32, 16, 4] (engine.weights.fifth_bits's
//           layout; zero for the 4-bit types), scales and minimums as
//           engine.quants.unpack_coded_groups gives them (the IQ4 types' codes name levels,
//           which the caller passes to the kernels)
// ds4::repack_int8_<isa>(raws, qtypes, order, K, pad_to) -> (q, scales, minimums)
//   the 8-bit grouped form of Q8_0 = 8, Q6_K = 14, Q3_K = 11 and Q2_K = 10 matrices, fused where
//           need be with the coded types above: q int8 [P / 16, K / S, S, 16] and scales
//           [P / 16, K / S, 16] at the smallest group S among the types (16 with a Q6_K, Q3_K or
//           Q2_K, else 32; a larger group's values repeated), minimums like the scales where any
//           type has them (zero for the others), else an empty tensor; w = q * scale (+ minimum)
//           as engine.quants.unpack_int8_groups gives them, laid out as engine.weights.int8_layout
//           lays them out (engine.weights.Int8Linear's layout).  Scales and minimums each float16
//           where every value is exactly a float16 (Q8_0's, float16 in the file, always are),
//           else float32.
// ds4::repack_kq_<isa>(raws, qtype, order, K, pad_to) -> (packed, sc, d, dmin)
//   Q6_K (14), Q3_K (11) or Q2_K (10) matrices at their own width in dense_linear.cpp's
//           kq_linear layout: packed uint8 [P / 16, K / 16, 192, 96 or 64], sc int8
//           [P / 16, K / 16, 16] and d float16 [P / 16, K / 256, 16], the file's fields (Q3_K's
//           6-bit scales minus 32; Q2_K's scale and minimum bytes as they are), and Q2_K's dmin
//           like d (empty for the others); padding rows zero
// One pass over the file's bytes, split over output column groups, instead of numpy's
// several whole-matrix copies: the embedded model's 120 matrices take milliseconds.
// It reads no file itself and checks only what it needs to stay in bounds.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "isa.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {
namespace repack {  // named, so that all.cpp can include every source in one unit

constexpr int64_t C = 16;  // output columns per column group
constexpr int64_t G = 32;  // inputs per group

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
                  Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23;

bool is_int4(int64_t t) { return t == Q4_0 || t == Q4_1 || t == Q4_K; }
bool is_coded(int64_t t) { return is_int4(t) || t == Q5_0 || t == Q5_1 || t == Q5_K || t == IQ4_NL || t == IQ4_XS; }
bool has_fifth_bit(int64_t t) { return t == Q5_0 || t == Q5_1 || t == Q5_K; }
bool super_blocks(int64_t t) {  // of 256 values
  return t == Q2_K || t == Q3_K || t == Q4_K || t == Q5_K || t == Q6_K || t == IQ4_XS;
}
bool sixteens(int64_t t) { return t == Q2_K || t == Q3_K || t == Q6_K; }  // a scale per 16 values
bool is_int8(int64_t t) { return t == Q8_0 || sixteens(t) || is_coded(t); }
// The types whose 8-bit form has a minimum (w = q * scale + minimum); the others' is q * scale.
bool has_minimum(int64_t t) { return t == Q4_1 || t == Q4_K || t == Q5_1 || t == Q5_K || t == Q2_K; }

// Bytes a row of K values takes in type t.
int64_t row_bytes(int64_t t, int64_t K) {
  switch (t) {
    case Q4_0: return K / 32 * 18;
    case Q4_1: return K / 32 * 20;
    case Q5_0: return K / 32 * 22;
    case Q5_1: return K / 32 * 24;
    case Q4_K: return K / 256 * 144;
    case Q5_K: return K / 256 * 176;
    case IQ4_NL: return K / 32 * 18;
    case IQ4_XS: return K / 256 * 136;
    case Q6_K: return K / 256 * 210;
    case Q3_K: return K / 256 * 110;
    case Q2_K: return K / 256 * 84;
    default: return K / 32 * 34;  // Q8_0
  }
}

// A k-quant's 6-bit scale and minimum of sub-block j from its 12 scale bytes (Q4_K, Q5_K).
inline void k_scale(const uint8_t* sc, int j, int& sv, int& mv) {
  if (j < 4) {
    sv = sc[j] & 63;
    mv = sc[j + 4] & 63;
  } else {
    sv = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 2) & 0x30);
    mv = (sc[j + 4] >> 4) | ((sc[j] >> 2) & 0x30);
  }
}

// Sub-block j's 32 codes from a run of 32 bytes holding sub-blocks 2i and 2i + 1 in its low
// and high nibbles (Q4_K, Q5_K), in `out`'s form below.
inline void run_nibbles(const uint8_t* run, int j, uint8_t out[16]) {
  for (int i = 0; i < 16; ++i)
    out[i] = (j & 1) ? static_cast<uint8_t>((run[i] >> 4) | (run[i + 16] & 0xF0))
                     : static_cast<uint8_t>((run[i] & 0x0F) | (run[i + 16] << 4));
}

// Input group b (32 values) of one matrix row: the 16 bytes that hold code i's low 4 bits in the
// low nibble and code i + 16's in the high one (Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL store exactly
// that), the fifth bits (bit i for code i; zero for 4-bit codes), and the group's scale and
// minimum (w = value(code) * scale + minimum), as engine.quants.unpack_coded_groups gives them.
inline void coded_group(int64_t qtype, const uint8_t* row, int64_t b, uint8_t out[16], uint32_t& high, float& scale,
                        float& minimum) {
  high = 0;
  minimum = 0.0f;
  switch (qtype) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1:
    case IQ4_NL: {  // blocks of 32: [d][m, Q4_1 and Q5_1][qh, the Q5 types][16 bytes of nibbles]
      const uint8_t* blk = row + b * (row_bytes(qtype, 32));
      const float d = f16(blk);
      scale = d;
      const bool m = qtype == Q4_1 || qtype == Q5_1;
      if (m) minimum = f16(blk + 2);
      if (qtype == Q4_0) minimum = -8.0f * d;
      if (qtype == Q5_0) minimum = -16.0f * d;
      const uint8_t* qs = blk + 2 + (m ? 2 : 0);
      if (has_fifth_bit(qtype)) {
        std::memcpy(&high, qs, 4);
        qs += 4;
      }
      std::memcpy(out, qs, 16);
      return;
    }
    case Q4_K:
    case Q5_K: {  // super-blocks of 256: [d][dmin][12 scale bytes]([qh: 32 bytes], Q5_K)[128 bytes]
      const int64_t bytes = qtype == Q4_K ? 144 : 176;
      const uint8_t* blk = row + (b / 8) * bytes;
      const int j = static_cast<int>(b % 8);
      int sv, mv;
      k_scale(blk + 4, j, sv, mv);
      scale = f16(blk) * static_cast<float>(sv);
      minimum = -(f16(blk + 2) * static_cast<float>(mv));
      run_nibbles(blk + (qtype == Q4_K ? 16 : 48) + (j / 2) * 32, j, out);
      if (qtype == Q5_K)  // value 32 j + i takes bit j of qh[i]
        for (int i = 0; i < 32; ++i) high |= static_cast<uint32_t>((blk[16 + i] >> j) & 1) << i;
      return;
    }
    default: {  // IQ4_XS: super-blocks of 256: [d][scales_h: u16][scales_l: 4 bytes][8 x 16 bytes]
      const uint8_t* blk = row + (b / 8) * 136;
      const int j = static_cast<int>(b % 8);
      uint16_t sh;
      std::memcpy(&sh, blk + 2, 2);
      const int ls = (((blk[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((sh >> (2 * j)) & 3) << 4)) - 32;
      scale = f16(blk) * static_cast<float>(ls);
      std::memcpy(out, blk + 8 + 16 * j, 16);
      return;
    }
  }
}

// The levels an IQ4 code names (ggml's kvalues_iq4nl; engine.quants.IQ4_LEVELS).
constexpr int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Value e (0..255) of a super-block: its code (Q6_K 0..63, Q3_K 0..7, Q2_K 0..3; w = (code - 32)
// or (code - 4) times the sub-block's scale, or code times it plus its minimum), and sub-block
// s's scale byte (Q6_K's and Q3_K's signed scale; Q2_K's scale and minimum nibbles).
inline int kq_code(int64_t qtype, const uint8_t* blk, int e) {
  const int h = e / 128, r = (e % 128) / 32, at = e % 32;
  if (qtype == Q6_K) {  // [ql: 128][qh: 64][scales: 16 x int8][d]
    const int lo = (blk[64 * h + 32 * (r & 1) + at] >> (4 * (r >> 1))) & 0x0F;
    return lo | (((blk[128 + 32 * h + at] >> (2 * r)) & 3) << 4);
  }
  if (qtype == Q2_K) return (blk[16 + 32 * h + at] >> (2 * r)) & 3;  // [scales: 16][qs: 64][d][dmin]
  // Q3_K: [hmask: 32][qs: 64][scales: 12][d]; a set high bit means "no offset of -4"
  return ((blk[32 + 32 * h + at] >> (2 * r)) & 3) | (((blk[at] >> (e / 32)) & 1) << 2);
}
inline int8_t kq_scale(int64_t qtype, const uint8_t* blk, int s) {
  if (qtype == Q6_K) return static_cast<int8_t>(blk[192 + s]);
  if (qtype == Q2_K) return static_cast<int8_t>(blk[s]);  // the scale and minimum nibbles, as they are
  const uint8_t* sc = blk + 96;  // as repack_int8 reads it
  const int low4 = s < 8 ? sc[s] & 0x0F : sc[s - 8] >> 4, high2 = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
  return static_cast<int8_t>((low4 | (high2 << 4)) - 32);
}

// Input group b (32 values) of one matrix row in 8-bit form: q[i] and the scale and minimum of
// each half of 16 (the same for the types with groups of 32), as engine.quants.unpack_int8_groups
// gives them: Q4_0 and Q5_0 as code - 8 and code - 16 times d, without a minimum, as gguf
// computes them; Q3_K as its 3-bit value minus 4 where its high bit is clear; the IQ4 types as
// their levels.
inline void int8_group(int64_t qtype, const uint8_t* row, int64_t b, int8_t q[32], float scale[2], float minimum[2]) {
  if (qtype == Q8_0) {
    const uint8_t* blk = row + b * 34;
    scale[0] = scale[1] = f16(blk);
    minimum[0] = minimum[1] = 0.0f;
    std::memcpy(q, blk + 2, 32);
    return;
  }
  if (qtype == Q6_K || qtype == Q3_K) {  // codes and 6-bit scales as repack_kq reads them
    const bool six = qtype == Q6_K;
    const uint8_t* blk = row + (b / 8) * (six ? 210 : 110);
    const int j = static_cast<int>(b % 8);
    for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(kq_code(qtype, blk, 32 * j + i) - (six ? 32 : 4));
    const float d = f16(blk + (six ? 208 : 108));
    for (int h = 0; h < 2; ++h) {
      scale[h] = d * static_cast<float>(kq_scale(qtype, blk, 2 * j + h));
      minimum[h] = 0.0f;
    }
    return;
  }
  if (qtype == Q2_K) {  // the same reading, a scale and a minimum nibble per 16 values
    const uint8_t* blk = row + (b / 8) * 84;
    const int j = static_cast<int>(b % 8);
    for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(kq_code(qtype, blk, 32 * j + i));
    for (int h = 0; h < 2; ++h) {
      const int nibbles = static_cast<uint8_t>(kq_scale(qtype, blk, 2 * j + h));
      scale[h] = f16(blk + 80) * static_cast<float>(nibbles & 0x0F);
      minimum[h] = -(f16(blk + 82) * static_cast<float>(nibbles >> 4));
    }
    return;
  }
  uint8_t bytes[16];
  uint32_t high;
  float sc, mn;
  coded_group(qtype, row, b, bytes, high, sc, mn);
  const int offset = qtype == Q4_0 ? 8 : qtype == Q5_0 ? 16 : 0;
  const bool levels = qtype == IQ4_NL || qtype == IQ4_XS;
  for (int i = 0; i < 32; ++i) {
    const int code = ((bytes[i % 16] >> (4 * (i / 16))) & 0x0F) | static_cast<int>(((high >> i) & 1) << 4);
    q[i] = levels ? IQ4_LEVELS[code] : static_cast<int8_t>(code - offset);
  }
  scale[0] = scale[1] = sc;
  minimum[0] = minimum[1] = has_minimum(qtype) ? mn : 0.0f;
}

// Where row r of the concatenated raws lives.
struct Rows {
  std::vector<const uint8_t*> ptr;
  std::vector<int64_t> first, bytes, type;
  int64_t total = 0;

  Rows(at::TensorList raws, const std::vector<int64_t>& qtypes) {
    for (size_t i = 0; i < raws.size(); ++i) {
      const at::Tensor& t = raws[i];
      TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kByte && t.is_contiguous(),
                  "repack: each raw matrix must be contiguous uint8 [rows, row bytes]");
      ptr.push_back(t.data_ptr<uint8_t>());
      first.push_back(total);
      bytes.push_back(t.size(1));
      type.push_back(qtypes.empty() ? 8 : qtypes[i]);
      total += t.size(0);
    }
  }
  std::pair<const uint8_t*, int64_t> row(int64_t r) const {
    TORCH_CHECK(r >= 0 && r < total, "repack: row ", r, " is outside the ", total, " rows given");
    size_t i = 0;
    while (i + 1 < first.size() && first[i + 1] <= r) ++i;
    return {ptr[i] + (r - first[i]) * bytes[i], type[i]};
  }
};

int64_t padded_rows(int64_t N, int64_t pad_to) {
  TORCH_CHECK(pad_to > 0 && pad_to % C == 0, "repack: pad_to must be a positive multiple of 16");
  return (N + pad_to - 1) / pad_to * pad_to;
}

int64_t row_width(const Rows& rows, int64_t K) {
  for (size_t i = 0; i < rows.ptr.size(); ++i) {
    const int64_t need = row_bytes(rows.type[i], K);
    TORCH_CHECK(rows.bytes[i] == need, "repack: matrix ", i, " has rows of ", rows.bytes[i], " bytes, not ", need);
  }
  return K;
}

// float32 `v` survives a round trip through float16 bit for bit (-0.0 included; a NaN may not).
inline bool half_exact(float v) {
#if defined(__F16C__)
  const float back = _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#else
  const float back = static_cast<float>(c10::Half(v));
#endif
  uint32_t a, b;
  std::memcpy(&a, &v, 4);
  std::memcpy(&b, &back, 4);
  return a == b;
}

// The shared pass of repack_int4 and repack_codes: `high` only where asked for.
//
// One output tile (16 columns x one input group) at a time: the 16 rows' blocks are read into
// the tile, which is then written out whole, so every output byte is written once, in order,
// into memory that was never zeroed (a fresh page costs a fault either way; a second pass over
// it does not).  Whether every scale survives float16 is decided in the same pass, so no
// float16 copy is made of the scales of a matrix that keeps float32 ones.
std::tuple<at::Tensor, at::Tensor, at::Tensor> repack_groups(at::TensorList raws, at::IntArrayRef qtypes,
                                                             const at::Tensor& order, int64_t K, int64_t pad_to,
                                                             bool codes, const char* op) {
  const std::vector<int64_t> types(qtypes.begin(), qtypes.end());
  TORCH_CHECK(types.size() == raws.size() && !raws.empty(), op, ": one type per raw matrix");
  for (int64_t t : types)
    TORCH_CHECK(codes ? is_coded(t) : is_int4(t), op, ": type ", t,
                codes ? " is not Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/IQ4_NL/IQ4_XS" : " is not Q4_0/Q4_1/Q4_K");
  TORCH_CHECK(K > 0 && K % 32 == 0, op, ": bad width ", K);
  for (int64_t t : types)
    TORCH_CHECK(!super_blocks(t) || K % 256 == 0, op, ": the k-quants and IQ4_XS need a width divisible by 256");
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong && order.is_contiguous(),
              op, ": order must be int64 [N]");
  const Rows rows(raws, types);
  row_width(rows, K);
  const int64_t N = order.size(0), P = padded_rows(N, pad_to), NG = P / C, KB = K / G;
  for (int64_t n = 0; n < N; ++n) rows.row(order.data_ptr<int64_t>()[n]);  // bounds, before any work
  at::Tensor packed = at::empty({NG, KB, 8, 32}, at::kByte);
  at::Tensor scales = at::empty({NG, KB, 2, C}, at::kFloat);
  at::Tensor high = at::empty({codes ? NG : 0, KB, 16, 4}, at::kByte);
  const int64_t* ord = order.data_ptr<int64_t>();
  uint8_t* p0 = packed.data_ptr<uint8_t>();
  float* s0 = scales.data_ptr<float>();
  uint8_t* h0 = high.data_ptr<uint8_t>();
  std::atomic<bool> inexact{false};
  at::parallel_for(0, NG, 1, [&](int64_t begin, int64_t end) {
    const uint8_t* src[C];
    int64_t type[C];
    bool exact = true;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t live = std::min(C, N - g * C);  // the rest are padding columns: zero
      for (int64_t j = 0; j < live; ++j) std::tie(src[j], type[j]) = rows.row(ord[g * C + j]);
      for (int64_t b = 0; b < KB; ++b) {
        uint8_t tile[C][16] = {};
        float sc[C] = {}, mn[C] = {};
        uint32_t pairs[16] = {};  // input pair p's mask, bit 2j + e: value 2p + e's fifth bit of column j
        for (int64_t j = 0; j < live; ++j) {
          uint32_t hb;
          coded_group(type[j], src[j], b, tile[j], hb, sc[j], mn[j]);
          if (hb != 0)
            for (int p = 0; p < 16; ++p) pairs[p] |= ((hb >> (2 * p)) & 3u) << (2 * j);
        }
        // chunk c's byte 2j + e: values 2c + e (low nibble) and 2c + e + 16 (high), i.e. byte 2c + e
        uint8_t* chunk = p0 + (g * KB + b) * 256;
        for (int c = 0; c < 8; ++c)
          for (int64_t j = 0; j < C; ++j) std::memcpy(chunk + c * 32 + 2 * j, tile[j] + 2 * c, 2);
        float* s = s0 + (g * KB + b) * 2 * C;
        std::memcpy(s, sc, sizeof sc);
        std::memcpy(s + C, mn, sizeof mn);
        if (codes) {
          uint8_t* masks = h0 + (g * KB + b) * 64;
          for (int p = 0; p < 16; ++p)
            for (int q = 0; q < 4; ++q) masks[p * 4 + q] = static_cast<uint8_t>(pairs[p] >> (8 * q));
        }
        for (int64_t j = 0; exact && j < live; ++j) exact = half_exact(sc[j]) && half_exact(mn[j]);
      }
    }
    if (!exact) inexact.store(true, std::memory_order_relaxed);
  });
  // The int4 kernels give the same bits with either width; float16 halves the bytes read.
  return {packed, inexact.load() ? scales : scales.to(at::kHalf), high};
}

std::tuple<at::Tensor, at::Tensor> repack_int4(at::TensorList raws, at::IntArrayRef qtypes, const at::Tensor& order,
                                               int64_t K, int64_t pad_to) {
  auto [packed, scales, high] = repack_groups(raws, qtypes, order, K, pad_to, false, "repack_int4");
  return {packed, scales};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> repack_codes(at::TensorList raws, at::IntArrayRef qtypes,
                                                            const at::Tensor& order, int64_t K, int64_t pad_to) {
  return repack_groups(raws, qtypes, order, K, pad_to, true, "repack_codes");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> repack_int8(at::TensorList raws, at::IntArrayRef qtypes,
                                                           const at::Tensor& order, int64_t K, int64_t pad_to) {
  const std::vector<int64_t> types(qtypes.begin(), qtypes.end());
  TORCH_CHECK(types.size() == raws.size() && !raws.empty(), "repack_int8: one type per raw matrix");
  for (int64_t t : types)
    TORCH_CHECK(is_int8(t), "repack_int8: type ", t, " is not an 8-bit grouped or coded type");
  TORCH_CHECK(K > 0 && K % G == 0, "repack_int8: needs matrices of a width divisible by 32");
  for (int64_t t : types)
    TORCH_CHECK(!super_blocks(t) || K % 256 == 0, "repack_int8: the k-quants and IQ4_XS need a width divisible by 256");
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong && order.is_contiguous(),
              "repack_int8: order must be int64 [N]");
  const Rows rows(raws, types);
  row_width(rows, K);
  bool sixteen = false, minimums = false;
  for (int64_t t : types) {
    sixteen |= sixteens(t);
    minimums |= has_minimum(t);
  }
  const int64_t N = order.size(0), P = padded_rows(N, pad_to), NG = P / C, KB = K / G, S = sixteen ? 16 : 32;
  for (int64_t n = 0; n < N; ++n) rows.row(order.data_ptr<int64_t>()[n]);  // bounds, before any work
  at::Tensor q = at::empty({NG, K / S, S, C}, at::kChar);  // one group of S inputs x 16 columns per [g, s]
  at::Tensor scales = at::empty({NG, K / S, C}, at::kFloat);
  at::Tensor mins = at::empty({minimums ? NG : 0, K / S, C}, at::kFloat);
  const int64_t* ord = order.data_ptr<int64_t>();
  int8_t* q0 = q.data_ptr<int8_t>();
  float* s0 = scales.data_ptr<float>();
  float* m0 = mins.data_ptr<float>();
  std::atomic<bool> scales_inexact{false}, mins_inexact{false};
  at::parallel_for(0, NG, 1, [&](int64_t begin, int64_t end) {
    const uint8_t* src[C];
    int64_t type[C];
    bool scales_exact = true, mins_exact = true;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t live = std::min(C, N - g * C);  // the rest are padding columns: zero
      for (int64_t j = 0; j < live; ++j) std::tie(src[j], type[j]) = rows.row(ord[g * C + j]);
      for (int64_t b = 0; b < KB; ++b) {  // one tile: 32 inputs x 16 columns, written in order
        int8_t tile[C][G] = {};
        float sc[C][2] = {}, mn[C][2] = {};
        for (int64_t j = 0; j < live; ++j) int8_group(type[j], src[j], b, tile[j], sc[j], mn[j]);
        int8_t* dst = q0 + (g * KB + b) * G * C;
        for (int64_t k = 0; k < G; ++k)
          for (int64_t j = 0; j < C; ++j) dst[k * C + j] = tile[j][k];
        const int64_t per = G / S;  // scale groups in this input group
        for (int64_t h = 0; h < per; ++h) {
          float* s = s0 + (g * (K / S) + b * per + h) * C;
          float* m = m0 + (g * (K / S) + b * per + h) * C;
          for (int64_t j = 0; j < C; ++j) {
            s[j] = sc[j][h];
            scales_exact = scales_exact && half_exact(s[j]);
            if (minimums) {
              m[j] = mn[j][h];
              mins_exact = mins_exact && half_exact(m[j]);
            }
          }
        }
      }
    }
    if (!scales_exact) scales_inexact.store(true, std::memory_order_relaxed);
    if (!mins_exact) mins_inexact.store(true, std::memory_order_relaxed);
  });
  // The int8 kernel widens float16 values exactly; float16 halves the bytes read.
  return {q, scales_inexact.load() ? scales : scales.to(at::kHalf), mins_inexact.load() ? mins : mins.to(at::kHalf)};
}

// Bytes of a k-quant tile (16 inputs x 16 columns) at the type's own width: Q6_K 192, Q3_K 96,
// Q2_K 64.
int64_t tile_bytes(int64_t qtype) { return qtype == Q6_K ? 192 : qtype == Q3_K ? 96 : 64; }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> repack_kq(at::TensorList raws, int64_t qtype,
                                                                     const at::Tensor& order, int64_t K, int64_t pad_to) {
  TORCH_CHECK(qtype == Q6_K || qtype == Q3_K || qtype == Q2_K, "repack_kq: type ", qtype, " is not Q6_K, Q3_K or Q2_K");
  TORCH_CHECK(!raws.empty() && K > 0 && K % 256 == 0, "repack_kq: needs matrices of a width divisible by 256");
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong && order.is_contiguous(),
              "repack_kq: order must be int64 [N]");
  const Rows rows(raws, std::vector<int64_t>(raws.size(), qtype));
  row_width(rows, K);
  const int64_t N = order.size(0), P = padded_rows(N, pad_to), NG = P / C, KB = K / 16, T = tile_bytes(qtype);
  const int64_t block = row_bytes(qtype, 256), d_at = qtype == Q6_K ? 208 : qtype == Q3_K ? 108 : 80;
  const bool two = qtype == Q2_K;  // with dmin beside d
  for (int64_t n = 0; n < N; ++n) rows.row(order.data_ptr<int64_t>()[n]);  // bounds, before any work
  at::Tensor packed = at::empty({NG, KB, T}, at::kByte);
  at::Tensor sc = at::empty({NG, KB, C}, at::kChar);
  at::Tensor d = at::empty({NG, KB / 16, C}, at::kHalf);
  at::Tensor dmin = at::empty({two ? NG : 0, KB / 16, C}, at::kHalf);
  const int64_t* ord = order.data_ptr<int64_t>();
  uint8_t* p0 = packed.data_ptr<uint8_t>();
  int8_t* c0 = sc.data_ptr<int8_t>();
  uint16_t* d0 = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  uint16_t* m0 = reinterpret_cast<uint16_t*>(dmin.data_ptr<at::Half>());
  at::parallel_for(0, NG, 1, [&](int64_t begin, int64_t end) {
    const uint8_t* src[C];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t live = std::min(C, N - g * C);  // the rest are padding columns: zero
      for (int64_t j = 0; j < live; ++j) src[j] = rows.row(ord[g * C + j]).first;
      for (int64_t b = 0; b < KB; ++b) {  // one tile: 16 inputs x 16 columns
        uint8_t code[256] = {};           // [input][column]
        int8_t scales[C] = {};
        uint16_t ds[C] = {}, dmins[C] = {};
        for (int64_t j = 0; j < live; ++j) {  // values 16 s .. 16 s + 15 of a super-block
          const uint8_t* blk = src[j] + (b / 16) * block;
          const int s = static_cast<int>(b % 16);
          for (int i = 0; i < 16; ++i) code[i * C + j] = static_cast<uint8_t>(kq_code(qtype, blk, 16 * s + i));
          scales[j] = kq_scale(qtype, blk, s);
          std::memcpy(&ds[j], blk + d_at, 2);
          if (two) std::memcpy(&dmins[j], blk + 82, 2);
        }
        // Q6_K: 128 bytes of low nibbles (byte i: codes i and i + 128), then 64 of bits 4-5;
        // Q3_K: 64 bytes of bits 0-1, then 32 of bit 2 (byte i: codes i + 32 m at shift m);
        // Q2_K: the 64 bytes of bits 0-1 alone.
        // A byte of bit pairs holds codes i, i + 64, i + 128 and i + 192 at shifts 0, 2, 4, 6.
        uint8_t* tile = p0 + (g * KB + b) * T;
        const int shift = qtype == Q6_K ? 4 : 0;  // where the pairs sit in the code
        if (qtype == Q6_K)
          for (int i = 0; i < 128; ++i) tile[i] = static_cast<uint8_t>((code[i] & 0x0F) | ((code[i + 128] & 0x0F) << 4));
        uint8_t* pairs = tile + (qtype == Q6_K ? 128 : 0);
        for (int i = 0; i < 64; ++i) {
          int v = 0;
          for (int m = 0; m < 4; ++m) v |= ((code[i + 64 * m] >> shift) & 3) << (2 * m);
          pairs[i] = static_cast<uint8_t>(v);
        }
        if (qtype == Q3_K)
          for (int i = 0; i < 32; ++i) {
            int v = 0;
            for (int m = 0; m < 8; ++m) v |= ((code[i + 32 * m] >> 2) & 1) << m;
            tile[64 + i] = static_cast<uint8_t>(v);
          }
        std::memcpy(c0 + (g * KB + b) * C, scales, C);
        if (b % 16 == 0) std::memcpy(d0 + (g * (KB / 16) + b / 16) * C, ds, sizeof ds);
        if (two && b % 16 == 0) std::memcpy(m0 + (g * (KB / 16) + b / 16) * C, dmins, sizeof dmins);
      }
    }
  });
  return {packed, sc, d, dmin};
}

}  // namespace repack
}  // namespace

TORCH_LIBRARY_FRAGMENT(ds4, m) {
  m.def(DS4_OP("repack_int4") "(Tensor[] raws, int[] qtypes, Tensor order, int K, int pad_to) -> (Tensor, Tensor)");
  m.def(DS4_OP("repack_codes") "(Tensor[] raws, int[] qtypes, Tensor order, int K, int pad_to) -> (Tensor, Tensor, Tensor)");
  m.def(DS4_OP("repack_int8") "(Tensor[] raws, int[] qtypes, Tensor order, int K, int pad_to) -> (Tensor, Tensor, Tensor)");
  m.def(DS4_OP("repack_kq") "(Tensor[] raws, int qtype, Tensor order, int K, int pad_to) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ds4, CPU, m) {
  m.impl(DS4_OP("repack_int4"), &repack::repack_int4);
  m.impl(DS4_OP("repack_codes"), &repack::repack_codes);
  m.impl(DS4_OP("repack_int8"), &repack::repack_int8);
  m.impl(DS4_OP("repack_kq"), &repack::repack_kq);
}
