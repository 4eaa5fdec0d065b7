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
// ds4::repack_q8_0_<isa>(raws, order, pad_to) -> (q, scales)
//   the same for Q8_0 matrices: q int8 [P / 16, K / 32, 32, 16], scales [P / 16, K / 32, 16]
//           in float16 (the file's own, so always exact; float32 if a NaN's bits would not survive)
//   (engine.weights.Int8Linear's layout)
// One pass over the file's bytes, split over output column groups, instead of numpy's
// several whole-matrix copies: the embedded model's 120 matrices take milliseconds.
// It reads no file itself and checks only what it needs to stay in bounds.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "isa.h"

namespace {
namespace repack {  // named, so that all.cpp can include every source in one unit

constexpr int64_t C = 16;  // output columns per column group
constexpr int64_t G = 32;  // inputs per group

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Input group b (32 values) of one matrix row: the 16 bytes that hold value i in the low nibble
// and value i + 16 in the high one (Q4_0 and Q4_1 store exactly that), with the group's scale
// and minimum (w = q * scale + minimum), as engine.quants.unpack_int4_groups computes them.
inline void int4_group(int64_t qtype, const uint8_t* row, int64_t b, uint8_t out[16], float& scale, float& minimum) {
  if (qtype == 2 || qtype == 3) {  // Q4_0, Q4_1: blocks of 32
    const uint8_t* blk = row + b * (qtype == 2 ? 18 : 20);
    const float d = f16(blk);
    scale = d;
    minimum = qtype == 2 ? -8.0f * d : f16(blk + 2);
    std::memcpy(out, blk + (qtype == 2 ? 2 : 4), 16);
    return;
  }
  // Q4_K: super-blocks of 256 with 8 sub-blocks of 32, 6-bit scales and minimums; the 32 bytes
  // of run j / 2 hold sub-block j in their low (even j) or high (odd j) nibbles.
  const uint8_t* blk = row + (b / 8) * 144;
  const int j = static_cast<int>(b % 8);
  const uint8_t* sc = blk + 4;
  int sv, mv;
  if (j < 4) {
    sv = sc[j] & 63;
    mv = sc[j + 4] & 63;
  } else {
    sv = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 2) & 0x30);
    mv = (sc[j + 4] >> 4) | ((sc[j] >> 2) & 0x30);
  }
  scale = f16(blk) * static_cast<float>(sv);
  minimum = -(f16(blk + 2) * static_cast<float>(mv));
  const uint8_t* run = blk + 16 + (j / 2) * 32;
  for (int i = 0; i < 16; ++i)
    out[i] = (j & 1) ? static_cast<uint8_t>((run[i] >> 4) | (run[i + 16] & 0xF0))
                     : static_cast<uint8_t>((run[i] & 0x0F) | (run[i + 16] << 4));
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
    const int64_t t = rows.type[i];
    const int64_t need = t == 2 ? K / 32 * 18 : t == 3 ? K / 32 * 20 : t == 12 ? K / 256 * 144 : K / 32 * 34;
    TORCH_CHECK(rows.bytes[i] == need, "repack: matrix ", i, " has rows of ", rows.bytes[i], " bytes, not ", need);
  }
  return K;
}

// float32 `values` as float16 when every value survives the round trip bit for bit (NaN
// payloads and -0.0 included), else `values` itself.
at::Tensor narrow_if_exact(const at::Tensor& values) {
  at::Tensor half = values.to(at::kHalf);
  const bool exact = half.to(at::kFloat).view(at::kInt).equal(values.view(at::kInt));
  return exact ? half : values;
}

std::tuple<at::Tensor, at::Tensor> repack_int4(at::TensorList raws, at::IntArrayRef qtypes, const at::Tensor& order,
                                               int64_t K, int64_t pad_to) {
  const std::vector<int64_t> types(qtypes.begin(), qtypes.end());
  TORCH_CHECK(types.size() == raws.size() && !raws.empty(), "repack_int4: one type per raw matrix");
  for (int64_t t : types) TORCH_CHECK(t == 2 || t == 3 || t == 12, "repack_int4: type ", t, " is not Q4_0/Q4_1/Q4_K");
  TORCH_CHECK(K > 0 && K % (types[0] == 12 ? 256 : 32) == 0, "repack_int4: bad width ", K);
  for (int64_t t : types) TORCH_CHECK(t != 12 || K % 256 == 0, "repack_int4: Q4_K needs a width divisible by 256");
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong && order.is_contiguous(),
              "repack_int4: order must be int64 [N]");
  const Rows rows(raws, types);
  row_width(rows, K);
  const int64_t N = order.size(0), P = padded_rows(N, pad_to), NG = P / C, KB = K / G;
  at::Tensor packed = at::zeros({NG, KB, 8, 32}, at::kByte);
  at::Tensor scales = at::zeros({NG, KB, 2, C}, at::kFloat);
  const int64_t* ord = order.data_ptr<int64_t>();
  uint8_t* p0 = packed.data_ptr<uint8_t>();
  float* s0 = scales.data_ptr<float>();
  at::parallel_for(0, NG, 1, [&](int64_t begin, int64_t end) {
    uint8_t bytes[16];
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t j = 0; j < C; ++j) {
        const int64_t n = g * C + j;
        if (n >= N) break;  // padding columns stay zero
        const auto [row, type] = rows.row(ord[n]);
        for (int64_t b = 0; b < KB; ++b) {
          float sc, mn;
          int4_group(type, row, b, bytes, sc, mn);
          // chunk c's byte 2j + e: values 2c + e (low nibble) and 2c + e + 16 (high), i.e. byte 2c + e
          uint8_t* chunk = p0 + ((g * KB + b) * 8) * 32 + 2 * j;
          for (int c = 0; c < 8; ++c) {
            chunk[c * 32] = bytes[2 * c];
            chunk[c * 32 + 1] = bytes[2 * c + 1];
          }
          s0[((g * KB + b) * 2) * C + j] = sc;
          s0[((g * KB + b) * 2 + 1) * C + j] = mn;
        }
      }
    }
  });
  return {packed, narrow_if_exact(scales)};
}

std::tuple<at::Tensor, at::Tensor> repack_q8_0(at::TensorList raws, const at::Tensor& order, int64_t K,
                                               int64_t pad_to) {
  TORCH_CHECK(!raws.empty() && K > 0 && K % G == 0, "repack_q8_0: needs matrices of a width divisible by 32");
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong && order.is_contiguous(),
              "repack_q8_0: order must be int64 [N]");
  const Rows rows(raws, {});
  row_width(rows, K);
  const int64_t N = order.size(0), P = padded_rows(N, pad_to), NG = P / C, KB = K / G;
  at::Tensor q = at::zeros({NG, KB, G, C}, at::kChar);
  at::Tensor scales = at::zeros({NG, KB, C}, at::kFloat);
  const int64_t* ord = order.data_ptr<int64_t>();
  int8_t* q0 = q.data_ptr<int8_t>();
  float* s0 = scales.data_ptr<float>();
  at::parallel_for(0, NG, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t j = 0; j < C; ++j) {
        const int64_t n = g * C + j;
        if (n >= N) break;
        const uint8_t* row = rows.row(ord[n]).first;
        for (int64_t b = 0; b < KB; ++b) {
          const uint8_t* blk = row + b * 34;
          s0[(g * KB + b) * C + j] = f16(blk);
          int8_t* dst = q0 + ((g * KB + b) * G) * C + j;
          for (int64_t k = 0; k < G; ++k) dst[k * C] = static_cast<int8_t>(blk[2 + k]);
        }
      }
    }
  });
  return {q, narrow_if_exact(scales)};  // Q8_0's scales are float16 in the file: always exact
}

}  // namespace repack
}  // namespace

TORCH_LIBRARY_FRAGMENT(ds4, m) {
  m.def(DS4_OP("repack_int4") "(Tensor[] raws, int[] qtypes, Tensor order, int K, int pad_to) -> (Tensor, Tensor)");
  m.def(DS4_OP("repack_q8_0") "(Tensor[] raws, Tensor order, int K, int pad_to) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ds4, CPU, m) {
  m.impl(DS4_OP("repack_int4"), &repack::repack_int4);
  m.impl(DS4_OP("repack_q8_0"), &repack::repack_q8_0);
}
