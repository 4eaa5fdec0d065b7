// A decoding layer on CPU in two ops per family (llama, Gemma): each calls the kernels the engine
// would otherwise call one by one from Python, in the same order on the same tensors, so it
// computes the same bits; what it saves is the dozens of Python calls and dispatches between
// them (about 0.4 ms of a 7 ms decoding step of SmolLM2-135M on two threads, and about 3 ms of
// a 12 ms step of Gemma 3 270M, whose layers have four norms and per-head q/k norms).
//
// A matrix is passed as its operands, a list: int4 (packed uint8, scales[, high uint8 or levels
// float32]) as int4_linear takes them, int8 (q int8, scales[, minimums]) as int8_linear does, or
// k-quant tiles (packed uint8, sc int8, d float16[, dmin]) as kq_linear does (AVX512 builds);
// no bias, its output exactly 16-column blocks wide.  An int4 matrix that adds into the residual
// stream adds in its last step (int4_linear_add); the others are computed, then added (the bits
// of `out += y`).
//
// ds4::attention_block_<isa>(x, norm, eps, qkv, rope, kv, positions, window, scale, wo) -> ()
//   x          [N, E] float32, contiguous: the residual stream, updated in place:
//              x += wo(attention(rotate(qkv(rms_norm(x, norm, eps)))))
//   qkv        the fused q/k/v projection's operands, output [N, (H + 2 Hkv) D]
//   rope       [N, D] float32 (rows may be strided): each row's rotations as (cos, sin) pairs,
//              applied to the adjacent pairs of every q and k head as torch multiplies
//              complex64 numbers: re = a c - b s, im = a s + b c, each product and the sum
//              rounded on its own (no fused multiply-add), so the bits equal the Python step's
//   kv, positions, window, scale: as decode_attention (decode_attention.cpp), which stores each row's
//              new key and value and attends
//   wo         the output projection's operands (H D inputs)
// ds4::ffn_block_<isa>(x, norm, eps, gate_up, down) -> ()
//   x += down(swiglu(gate_up(rms_norm(x, norm, eps)))), the same way.
//
// ds4::rotate_halves_<isa>(qkv, heads, q_norm, k_norm, eps, cos, sin) -> ()
//   qkv        [N, (H + 2 Hkv) D] float32, rows may be strided, each row contiguous; H = heads.
//              In place, on each of the H query heads and then the Hkv key heads: RMSNorm over
//              the head's D values with q_norm (k_norm) where given (rms_norm's arithmetic),
//              then the neox rotation, dimension i with i + D/2:
//              a' = a c - b s, b' = b c + a s, each product and the sum rounded on its own,
//              as torch computes it from cos and sin [N, D/2] float32 (rows may be strided)
// ds4::gemma_attention_block_<isa>(x, norm, post_norm, eps, qkv, q_norm, k_norm, cos, sin, kv,
//                                  positions, window, scale, softcap, wo) -> ()
//   x += rms_norm(wo(attention(rotate_halves(qkv(rms_norm(x, norm))))), post_norm), attention
//   being decode_attention with the layer's window (0: none) and score cap (0: none)
// ds4::gemma_ffn_block_<isa>(x, norm, post_norm, eps, gate_up, down) -> ()
//   x += rms_norm(down(geglu(gate_up(rms_norm(x, norm)))), post_norm)
// The Python steps that these ops replace call rotate_halves, rms_norm, geglu, the products and
// decode_attention as separate ops, so a layer run either way gives the same bits.
// Ops of the vector libraries only (avx512, avx2, portable): the tile op of the amx path is for
// 32 rows and more, where the dispatches no longer matter.  None handles biases, padding
// columns, float16 matrices or other feed-forward networks; the engine keeps its Python step
// for those.
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

// Q6_K, Q3_K or Q2_K at their own width (packed uint8, sc int8, d float16[, dmin float16]),
// where the build has kq_linear.
bool is_kq(at::TensorList w) {
  return (w.size() == 3 || w.size() == 4) && w[0].scalar_type() == at::kByte && w[1].scalar_type() == at::kChar;
}
bool is_int4(at::TensorList w) {
  return w.size() >= 2 && w.size() <= 3 && w[0].scalar_type() == at::kByte && !is_kq(w);
}

void check_matrix(at::TensorList w, const char* op, const char* name) {
#if !defined(__AVX512BW__)
  TORCH_CHECK(!is_kq(w), op, ": ", name, " is a k-quant tile matrix, which this build does not compute");
#endif
  TORCH_CHECK(is_int4(w) || is_kq(w) || (w.size() >= 2 && w.size() <= 3 && w[0].scalar_type() == at::kChar), op,
              ": ", name,
              " must be int4 operands (packed uint8, scales[, high uint8 or levels float32]), int8 ones (q int8, "
              "scales[, minimums]) or k-quant tiles (packed uint8, sc int8, d float16[, dmin float16])");
}

// An int4 matrix's third operand, where it has one: its fifth bits (uint8) or its levels (float).
c10::optional<at::Tensor> int4_high(at::TensorList w) {
  return w.size() == 3 && w[2].scalar_type() == at::kByte ? c10::optional<at::Tensor>(w[2]) : c10::nullopt;
}
c10::optional<at::Tensor> int4_levels(at::TensorList w) {
  return w.size() == 3 && w[2].scalar_type() != at::kByte ? c10::optional<at::Tensor>(w[2]) : c10::nullopt;
}

// The matrix's inputs and its outputs (16-column blocks), from its operands' shapes.
int64_t inputs_of(at::TensorList w) {
  if (is_kq(w)) return w[0].dim() == 3 ? w[0].size(1) * 16 : 0;
  return w[0].dim() == 4 ? w[0].size(1) * (is_int4(w) ? int4::G : w[0].size(2)) : 0;
}
int64_t outputs_of(at::TensorList w) { return w[0].dim() == 4 || is_kq(w) ? w[0].size(0) * int4::C : 0; }

at::Tensor product(const at::Tensor& x, at::TensorList w) {
#if defined(__AVX512BW__)
  if (is_kq(w)) return dense::kq_linear(x, w[0], w[1], w[2], w.size() == 4 ? c10::optional<at::Tensor>(w[3]) : c10::nullopt);
#endif
  if (is_int4(w)) return int4::int4_linear(x, w[0], w[1], int4_high(w), int4_levels(w));
  return dense::int8_linear(x, w[0], w[1], w.size() == 3 ? c10::optional<at::Tensor>(w[2]) : c10::nullopt);
}

void add_product(const at::Tensor& x, at::TensorList w, at::Tensor& out) {
  if (is_int4(w)) {
    int4::int4_linear_add(x, w[0], w[1], out, int4_high(w), int4_levels(w));
  } else {
    out.add_(product(x, w));
  }
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

// H from the output projection's inputs; checks that q/k/v's width fits H, the caches' heads and D.
int64_t query_heads(at::TensorList qkv, at::TensorList wo, at::TensorList kv, const char* op) {
  check_matrix(qkv, op, "qkv");
  check_matrix(wo, op, "wo");
  TORCH_CHECK(!kv.empty(), op, ": needs one cache per row");
  const int64_t Hkv = kv[0].size(1), D = kv[0].size(3);
  const int64_t H = inputs_of(wo) / D, width = outputs_of(qkv);
  TORCH_CHECK(H > 0 && (H + 2 * Hkv) * D == width, op, ": the q/k/v projection's width ", width, " does not fit ", H,
              " query heads (the output projection's inputs) and the caches' ", Hkv, " heads of ", D);
  return H;
}

void attention_block(at::Tensor x, const at::Tensor& norm, double eps, at::TensorList qkv_w, const at::Tensor& rope,
                     at::TensorList kv, at::IntArrayRef positions, int64_t window, double scale, at::TensorList wo) {
  check_residual(x, "attention_block");
  const int64_t H = query_heads(qkv_w, wo, kv, "attention_block");
  const int64_t Hkv = kv[0].size(1), D = kv[0].size(3);
  TORCH_CHECK(rope.dim() == 2 && rope.scalar_type() == at::kFloat && rope.stride(1) == 1 &&
                  rope.size(0) == x.size(0) && rope.size(1) == D,
              "attention_block: rope must be float32 [N, head dim] with contiguous rows");
  at::Tensor qkv = product(elementwise::rms_norm(x, norm, eps), qkv_w);
  rotate(qkv, rope, H + Hkv, D);
  add_product(attention::decode_attention(qkv, kv, positions, scale, window, 0.0), wo, x);
}

void ffn_block(at::Tensor x, const at::Tensor& norm, double eps, at::TensorList gate_up, at::TensorList down) {
  check_residual(x, "ffn_block");
  check_matrix(gate_up, "ffn_block", "gate_up");
  check_matrix(down, "ffn_block", "down");
  add_product(elementwise::swiglu(product(elementwise::rms_norm(x, norm, eps), gate_up)), down, x);
}

// --- Gemma ---

const float* norm_weights(const c10::optional<at::Tensor>& w, int64_t D, const char* name) {
  if (!w.has_value()) return nullptr;
  TORCH_CHECK(w->dim() == 1 && w->size(0) == D && w->scalar_type() == at::kFloat && w->is_contiguous(),
              "rotate_halves: ", name, " must be contiguous float32 [", D, "]");
  return w->data_ptr<float>();
}

DS4_ENTRY void rotate_halves(at::Tensor qkv, int64_t heads, const c10::optional<at::Tensor>& q_norm,
                             const c10::optional<at::Tensor>& k_norm, double eps, const at::Tensor& cos,
                             const at::Tensor& sin) {
  TORCH_CHECK(cos.dim() == 2 && cos.scalar_type() == at::kFloat && cos.stride(1) == 1 && cos.sizes() == sin.sizes() &&
                  sin.scalar_type() == at::kFloat && sin.stride(1) == 1,
              "rotate_halves: cos and sin must be float32 [N, D/2] with contiguous rows");
  const int64_t N = qkv.size(0), half = cos.size(1), D = 2 * half;
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1 && cos.size(0) == N,
              "rotate_halves: qkv must be float32 [N, (H + 2 Hkv) D] with contiguous rows, one per cos row");
  TORCH_CHECK(D > 0 && heads > 0 && qkv.size(1) % D == 0 && (qkv.size(1) / D - heads) % 2 == 0 &&
                  qkv.size(1) / D > heads,
              "rotate_halves: qkv's width ", qkv.size(1), " is not ", heads, " query heads and two equal kv parts of ", D);
  const int64_t kv_heads = (qkv.size(1) / D - heads) / 2;
  const float* norms[2] = {norm_weights(q_norm, D, "q_norm"), norm_weights(k_norm, D, "k_norm")};
  const float inv_d = 1.0f / static_cast<float>(D), feps = static_cast<float>(eps);
  float* q0 = qkv.data_ptr<float>();
  for (int64_t r = 0; r < N; ++r) {
    float* row = q0 + r * qkv.stride(0);
    const float* c = cos.data_ptr<float>() + r * cos.stride(0);
    const float* s = sin.data_ptr<float>() + r * sin.stride(0);
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      float* a = row + h * D;
      float* b = a + half;
      const float* w = norms[h < heads ? 0 : 1];
      if (w != nullptr) elementwise::norm_row(a, w, D, inv_d, feps, a);
      for (int64_t i = 0; i < half; ++i) {
        const float x = a[i], y = b[i];
        const float xc = rounded(x * c[i]), ys = rounded(y * s[i]), yc = rounded(y * c[i]), xs = rounded(x * s[i]);
        a[i] = xc - ys;
        b[i] = yc + xs;
      }
    }
  }
}

void gemma_attention_block(at::Tensor x, const at::Tensor& norm, const at::Tensor& post_norm, double eps,
                           at::TensorList qkv_w, const c10::optional<at::Tensor>& q_norm,
                           const c10::optional<at::Tensor>& k_norm, const at::Tensor& cos, const at::Tensor& sin,
                           at::TensorList kv, at::IntArrayRef positions, int64_t window, double scale, double softcap,
                           at::TensorList wo) {
  check_residual(x, "gemma_attention_block");
  const int64_t H = query_heads(qkv_w, wo, kv, "gemma_attention_block");
  at::Tensor qkv = product(elementwise::rms_norm(x, norm, eps), qkv_w);
  rotate_halves(qkv, H, q_norm, k_norm, eps, cos, sin);
  const at::Tensor att = attention::decode_attention(qkv, kv, positions, scale, window, softcap);
  x.add_(elementwise::rms_norm(product(att, wo), post_norm, eps));
}

void gemma_ffn_block(at::Tensor x, const at::Tensor& norm, const at::Tensor& post_norm, double eps,
                     at::TensorList gate_up, at::TensorList down) {
  check_residual(x, "gemma_ffn_block");
  check_matrix(gate_up, "gemma_ffn_block", "gate_up");
  check_matrix(down, "gemma_ffn_block", "down");
  const at::Tensor act = elementwise::geglu(product(elementwise::rms_norm(x, norm, eps), gate_up));
  x.add_(elementwise::rms_norm(product(act, down), post_norm, eps));
}

}  // namespace block
}  // namespace

TORCH_LIBRARY_FRAGMENT(ds4, m) {
  m.def(DS4_OP("attention_block") "(Tensor(a!) x, Tensor norm, float eps, Tensor[] qkv, Tensor rope, "
                                  "Tensor(b!)[] kv, int[] positions, int window, float scale, Tensor[] wo) -> ()");
  m.def(DS4_OP("ffn_block") "(Tensor(a!) x, Tensor norm, float eps, Tensor[] gate_up, Tensor[] down) -> ()");
  m.def(DS4_OP("rotate_halves") "(Tensor(a!) qkv, int heads, Tensor? q_norm, Tensor? k_norm, float eps, Tensor cos, "
                                "Tensor sin) -> ()");
  m.def(DS4_OP("gemma_attention_block") "(Tensor(a!) x, Tensor norm, Tensor post_norm, float eps, Tensor[] qkv, "
                                        "Tensor? q_norm, Tensor? k_norm, Tensor cos, Tensor sin, Tensor(b!)[] kv, "
                                        "int[] positions, int window, float scale, float softcap, Tensor[] wo) -> ()");
  m.def(DS4_OP("gemma_ffn_block") "(Tensor(a!) x, Tensor norm, Tensor post_norm, float eps, Tensor[] gate_up, "
                                  "Tensor[] down) -> ()");
}

TORCH_LIBRARY_IMPL(ds4, CPU, m) {
  m.impl(DS4_OP("attention_block"), &block::attention_block);
  m.impl(DS4_OP("ffn_block"), &block::ffn_block);
  m.impl(DS4_OP("rotate_halves"), &block::rotate_halves);
  m.impl(DS4_OP("gemma_attention_block"), &block::gemma_attention_block);
  m.impl(DS4_OP("gemma_ffn_block"), &block::gemma_ffn_block);
}
