// A llama-family decoding layer on CPU in two ops: each calls the kernels the engine would
// otherwise call one by one from Python, in the same order on the same tensors, so it computes
// the same bits; what it saves is the dozen Python calls and dispatches between them (about
// 0.4 ms of a 7 ms decoding step of SmolLM2-135M on two threads).
//
// ds4::attention_block_<isa>(x, norm, eps, qkv_packed, qkv_scales, rope, kv, positions, scale,
//                            wo_packed, wo_scales) -> ()
//   x          [N, E] float32, contiguous: the residual stream, updated in place:
//              x += wo(attention(rotate(qkv(rms_norm(x, norm, eps)))))
//   qkv_*      the fused q/k/v projection's int4 operands (int4_linear.cpp), no bias, its
//              output [N, (H + 2 Hkv) D] exactly 16-column blocks wide
//   rope       [N, D] float32 (rows may be strided): each row's rotations as (cos, sin) pairs,
//              applied to the adjacent pairs of every q and k head as torch multiplies
//              complex64 numbers: re = a c - b s, im = a s + b c, each product and the sum
//              rounded on its own (no fused multiply-add), so the bits equal the Python step's
//   kv, positions, scale: as decode_attention (decode_attention.cpp), without a window or
//              capping, which stores each row's new key and value and attends
//   wo_*       the output projection's int4 operands, added into x by int4_linear_add
// ds4::ffn_block_<isa>(x, norm, eps, gate_up_packed, gate_up_scales, down_packed, down_scales) -> ()
//   x += down(swiglu(gate_up(rms_norm(x, norm, eps)))), the same way.
// Ops of the vector libraries only (avx512, avx2, portable): the tile op of the amx path is for
// 32 rows and more, where the dispatches no longer matter.  Neither op handles biases, per-head
// q/k norms or other feed-forward networks; the engine keeps its Python step for those.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "isa.h"

namespace {
namespace block {  // named, so that all.cpp can include every source in one unit

// Each product rounded on its own: the empty asm makes the compiler hold it as a value, so it
// cannot fuse it into the addition that follows (GCC contracts a * c - b * s otherwise).
inline float rounded(float v) {
  asm("" : "+x"(v));
  return v;
}

// The rotation of q's and k's heads, in place, as torch's complex multiply rounds it.
void rotate(at::Tensor& qkv, const at::Tensor& rope, int64_t heads, int64_t D) {
  const int64_t N = qkv.size(0), pairs = D / 2;
  float* q0 = qkv.data_ptr<float>();
  const float* r0 = rope.data_ptr<float>();
  for (int64_t r = 0; r < N; ++r) {
    float* row = q0 + r * qkv.stride(0);
    const float* rot = r0 + r * rope.stride(0);
    for (int64_t h = 0; h < heads; ++h) {
      float* v = row + h * D;
      for (int64_t i = 0; i < pairs; ++i) {
        const float a = v[2 * i], b = v[2 * i + 1], c = rot[2 * i], s = rot[2 * i + 1];
        const float ac = rounded(a * c), bs = rounded(b * s), as = rounded(a * s), bc = rounded(b * c);
        v[2 * i] = ac - bs;
        v[2 * i + 1] = as + bc;
      }
    }
  }
}

void check_residual(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be contiguous float32 [N, E]");
}

void attention_block(at::Tensor x, const at::Tensor& norm, double eps, const at::Tensor& qkv_packed,
                     const at::Tensor& qkv_scales, const at::Tensor& rope, at::TensorList kv,
                     at::IntArrayRef positions, double scale, const at::Tensor& wo_packed,
                     const at::Tensor& wo_scales) {
  check_residual(x, "attention_block");
  TORCH_CHECK(!kv.empty(), "attention_block: needs one cache per row");
  const int64_t Hkv = kv[0].size(1), D = kv[0].size(3);
  TORCH_CHECK(rope.dim() == 2 && rope.scalar_type() == at::kFloat && rope.stride(1) == 1 &&
                  rope.size(0) == x.size(0) && rope.size(1) == D,
              "attention_block: rope must be float32 [N, head dim] with contiguous rows");
  // The output projection's inputs are the H query heads; the caches give Hkv and D.
  const int64_t H = wo_packed.dim() == 4 ? wo_packed.size(1) * int4::G / D : 0;
  const int64_t width = qkv_packed.dim() == 4 ? qkv_packed.size(0) * int4::C : 0;
  TORCH_CHECK(H > 0 && (H + 2 * Hkv) * D == width, "attention_block: the q/k/v projection's width ", width,
              " does not fit ", H, " query heads (the output projection's inputs) and the caches' ", Hkv,
              " heads of ", D);
  at::Tensor qkv = int4::int4_linear(elementwise::rms_norm(x, norm, eps), qkv_packed, qkv_scales);
  rotate(qkv, rope, H + Hkv, D);
  int4::int4_linear_add(attention::decode_attention(qkv, kv, positions, scale, 0, 0.0), wo_packed, wo_scales, x);
}

void ffn_block(at::Tensor x, const at::Tensor& norm, double eps, const at::Tensor& gate_up_packed,
               const at::Tensor& gate_up_scales, const at::Tensor& down_packed, const at::Tensor& down_scales) {
  check_residual(x, "ffn_block");
  const at::Tensor gate_up = int4::int4_linear(elementwise::rms_norm(x, norm, eps), gate_up_packed, gate_up_scales);
  int4::int4_linear_add(elementwise::swiglu(gate_up), down_packed, down_scales, x);
}

}  // namespace block
}  // namespace

TORCH_LIBRARY_FRAGMENT(ds4, m) {
  m.def(DS4_OP("attention_block") "(Tensor(a!) x, Tensor norm, float eps, Tensor qkv_packed, Tensor qkv_scales, "
                                  "Tensor rope, Tensor(b!)[] kv, int[] positions, float scale, Tensor wo_packed, "
                                  "Tensor wo_scales) -> ()");
  m.def(DS4_OP("ffn_block") "(Tensor(a!) x, Tensor norm, float eps, Tensor gate_up_packed, Tensor gate_up_scales, "
                            "Tensor down_packed, Tensor down_scales) -> ()");
}

TORCH_LIBRARY_IMPL(ds4, CPU, m) {
  m.impl(DS4_OP("attention_block"), &block::attention_block);
  m.impl(DS4_OP("ffn_block"), &block::ffn_block);
}
