// exp(x) for x <= 0 over the compiler's generic float vectors, shared by the kernels that need
// it (decode_attention.cpp's softmax, elementwise.cpp's SwiGLU).
//
// 2^n * p(r), r = x - n ln2, |r| <= ln2 / 2, with a degree-6 polynomial: within 2 ulp of exp.
// Below -87 the result is clamped to about 1e-38 instead of 0.  VF is a vector of floats and VI
// the vector of int32 of the same length.  The operations and their order are fixed, so a build
// computes the same bits for a value wherever it sits in a vector; builds for different
// instruction sets may differ in the last bit where one fuses a multiply-add the other does not.
#pragma once

#include <cstring>

namespace ds4_math {

template <typename VF, typename VI>
inline VF exp_nonpositive(VF x) {
  const VF zero{};
  const VF lo = zero - 87.0f;
  x = x < lo ? lo : x;
  const VF magic = zero + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  VF t = x * 1.44269504088896341f + magic;
  VF n = t - magic;
  VF r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  VF p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  VF scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace ds4_math
