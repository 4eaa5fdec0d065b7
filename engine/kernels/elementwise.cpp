// Row-wise elementwise work of a forward step on CPU, fused so that a decoding step dispatches
// one op where torch would dispatch several: the RMSNorm, the SwiGLU and the GeGLU.
//
// ds4::rms_norm_<isa>(x, w, eps) -> y          (isa: see isa.h)
//   x    [M, K] float32, rows may be strided, each row contiguous
//   w    [K] float32, contiguous
//   y    [M, K] float32, y[r] = (x[r] * (1 / sqrt(sum(x[r]^2) / K + eps))) * w
// The sum of squares runs in 16 lanes (input k to lane k % 16, in input order), then a fixed
// tree over the lanes; the scale is one float32 square root and one division.  A row's result
// depends on that row alone, in that fixed order: the same whatever the number of rows and
// the thread count, so prefill chunks and decoding steps normalise a row to the same bits.
//
// ds4::swiglu_<isa>(gate_up) -> y
//   gate_up [M, 2F] float32, rows may be strided, each row contiguous: gate then up
//   y       [M, F] float32, y[r, i] = silu(g) * u with g = gate_up[r, i], u = gate_up[r, F + i],
//           silu(g) = g / (1 + e) for g >= 0 and g * e / (1 + e) below, e = exp(-|g|) (vexp.h,
//           within 2 ulp; the argument is never positive, so nothing overflows)
// Elementwise, so a value's result depends on that value alone.
//
// ds4::geglu_<isa>(gate_up) -> y
//   the same shapes; y[r, i] = gelu(g) * u with GELU's tanh approximation (Gemma's), computed
//   as g * sigmoid(a), a = 2 * sqrt(2 / pi) * (g + 0.044715 * g^3) (0.5 * (1 + tanh(a / 2)) is
//   sigmoid(a)), the sigmoid as in the SwiGLU: within a few ulp of torch's
//   gelu(approximate="tanh"), elementwise.
//
// Neither matches torch's own ops bit for bit (reduction order, exp); they are not used where
// torch's run (CUDA, the `torch` path), and prefill and decoding both use them on CPU.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.h"
#include "vexp.h"

namespace {
namespace elementwise {  // named, so that all.cpp can include every source in one unit

constexpr int64_t L = 16;  // lanes of the sum of squares
typedef float vf __attribute__((vector_size(L * sizeof(float))));

inline float sum_of_squares(const float* x, int64_t K) {
  vf acc = {};
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    vf v;
    std::memcpy(&v, x + k, sizeof v);
    acc += v * v;
  }
  float lanes[L];
  std::memcpy(lanes, &acc, sizeof lanes);
  for (int64_t j = 0; k < K; ++k, ++j) lanes[j] += x[k] * x[k];  // the tail continues the lanes
  for (int64_t half = L / 2; half >= 1; half /= 2)
    for (int64_t j = 0; j < half; ++j) lanes[j] += lanes[j + half];
  return lanes[0];
}

// One row's RMSNorm, y may be x: the op's arithmetic, also what block.cpp normalises heads with.
DS4_ENTRY void norm_row(const float* x, const float* w, int64_t K, float inv_k, float eps, float* y) {
  const float scale = 1.0f / std::sqrt(sum_of_squares(x, K) * inv_k + eps);
  for (int64_t k = 0; k < K; ++k) y[k] = (x[k] * scale) * w[k];
}

DS4_ENTRY at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "rms_norm: x must be [M, K] float32 with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == K && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "rms_norm: w must be contiguous float32 [K]");
  at::Tensor y = at::empty({M, K}, x.options());
  const float* x0 = x.data_ptr<float>();
  const float* w0 = w.data_ptr<float>();
  float* y0 = y.data_ptr<float>();
  const int64_t stride = x.stride(0);
  const float feps = static_cast<float>(eps), inv_k = 1.0f / static_cast<float>(K);
  // Small work is not worth waking the other threads for: one decoding row is ~1 us.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(x0 + r * stride, w0, K, inv_k, feps, y0 + r * K);
  });
  return y;
}

constexpr int64_t V = 8;  // floats per SwiGLU vector
typedef float vf8 __attribute__((vector_size(V * sizeof(float))));
typedef int32_t vi8 __attribute__((vector_size(V * sizeof(int32_t))));

inline vf8 silu_times(vf8 g, vf8 u) {
  const vf8 zero{};
  const vf8 e = ds4_math::exp_nonpositive<vf8, vi8>(g < zero ? g : -g);
  const vf8 s = (g < zero ? g * e : g) / (1.0f + e);
  return s * u;
}

// g * sigmoid(a) * u: e = exp(-|a|), sigmoid(a) = 1 / (1 + e) for a >= 0 and e / (1 + e) below.
inline vf8 gated(vf8 g, vf8 a, vf8 u) {
  const vf8 zero{};
  const vf8 e = ds4_math::exp_nonpositive<vf8, vi8>(a < zero ? a : -a);
  const vf8 s = (a < zero ? g * e : g) / (1.0f + e);
  return s * u;
}

inline vf8 gelu_times(vf8 g, vf8 u) {
  const vf8 a = (g + 0.044715f * (g * g * g)) * 1.5957691216057308f;  // 2 * sqrt(2 / pi)
  return gated(g, a, u);
}

// y = act(gate) * up, row by row, 8 values at a time (the tail through the same vector code).
template <vf8 (*Act)(vf8, vf8)>
at::Tensor glu(const at::Tensor& gate_up, const char* name) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              name, ": gate_up must be [M, 2F] float32 with contiguous rows");
  const int64_t M = gate_up.size(0), F = gate_up.size(1) / 2;
  at::Tensor y = at::empty({M, F}, gate_up.options());
  const float* g0 = gate_up.data_ptr<float>();
  float* y0 = y.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1));
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = g0 + r * stride;
      const float* u = g + F;
      float* yr = y0 + r * F;
      int64_t i = 0;
      for (; i + V <= F; i += V) {
        vf8 gv, uv;
        std::memcpy(&gv, g + i, sizeof gv);
        std::memcpy(&uv, u + i, sizeof uv);
        const vf8 out = Act(gv, uv);
        std::memcpy(yr + i, &out, sizeof out);
      }
      if (i < F) {  // the tail through the same vector code, so its values round alike
        vf8 gv{}, uv{};
        std::memcpy(&gv, g + i, (F - i) * sizeof(float));
        std::memcpy(&uv, u + i, (F - i) * sizeof(float));
        const vf8 out = Act(gv, uv);
        std::memcpy(yr + i, &out, (F - i) * sizeof(float));
      }
    }
  });
  return y;
}

DS4_ENTRY at::Tensor swiglu(const at::Tensor& gate_up) { return glu<silu_times>(gate_up, "swiglu"); }
DS4_ENTRY at::Tensor geglu(const at::Tensor& gate_up) { return glu<gelu_times>(gate_up, "geglu"); }

}  // namespace elementwise
}  // namespace

TORCH_LIBRARY_FRAGMENT(ds4, m) {
  m.def(DS4_OP("rms_norm") "(Tensor x, Tensor w, float eps) -> Tensor");
  m.def(DS4_OP("swiglu") "(Tensor gate_up) -> Tensor");
  m.def(DS4_OP("geglu") "(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(ds4, CPU, m) {
  m.impl(DS4_OP("rms_norm"), &elementwise::rms_norm);
  m.impl(DS4_OP("swiglu"), &elementwise::swiglu);
  m.impl(DS4_OP("geglu"), &elementwise::geglu);
}
