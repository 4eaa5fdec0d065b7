// Decode attention on CPU: one new token per sequence, against that sequence's own cache.
//
// ds4::decode_attention_<isa>(qkv, kv, positions, scale, window=0, softcap=0) -> out  (isa: isa.h)
//   qkv        [N, (H + 2 Hkv) D] float32: each row's rotated queries, keys and values; rows
//              may be strided, each row contiguous; D a multiple of 16 up to 256
//   kv         N distinct tensors [2, Hkv, capacity, D], float32 or float16 (K then V), each position's
//              D values contiguous; outer strides are free, so pooled slots are views.  Position
//              p lives in slot p % capacity: a cache of every position never wraps, a ring of
//              the last `capacity` positions does
//   positions  row i's new key and value are written at position p = positions[i] of kv[i], and
//              its queries attend to positions [lo, p]: lo = max(0, p + 1 - window) with a
//              window (> 0), else 0; those p - lo + 1 keys must fit in the capacity
//   out        [N, H D] float32, scaled dot-product attention with scale `scale`; softcap > 0
//              first turns each scaled score s into softcap tanh(s / softcap) (Gemma's capping)
// Query head j reads kv head j / (H / Hkv) (grouped-query attention).
//
// ds4::prefill_attention_<isa>(q, kv, start, scale, window=0, softcap=0) -> out
//   q          [T, H D] float32: the rotated queries of positions start .. start + T - 1 (rows
//              may be strided, each row contiguous)
//   kv         one cache [2, Hkv, capacity, D] that already holds the positions the rows attend,
//              from the first row's lo to start + T - 1, each at slot p % capacity
//   out        [T, H D] float32: row i attends to positions [lo, start + i] as above, by the
//              very operations decode_attention runs for a row at position start + i
// So a prompt prefilled in chunks and the same tokens decoded one by one attend alike, bit
// for bit: the difference that the activations' rounding to bfloat16 would otherwise amplify
// into visibly different log-probabilities.
//
// Each (row, kv head) pair is one job that one thread runs start to finish (a long row's pair is
// one job per span of 512 keys, merged after: see `S`), in an order of operations fixed by that
// row's number of keys alone: a row's result is bitwise the same whatever the other rows, their
// number, the thread count and where the ring wraps among its keys.  That is what lets batched
// decoding reproduce single-row decoding exactly while still reading each cache once per step,
// without padding.
// Softmax runs in float32 with a vectorised exp (within 2 ulp) and the usual max shift; the
// capping's tanh is built on the same exp (ds4::attention_softcap_<isa>(scores, softcap) applies
// it alone, for tests).
// The code is written once in the compiler's generic vectors of 16 floats, which each library
// lowers to its instruction set (isa.h); float16 caches are widened with AVX512F or F16C where
// the build has them.  Builds for different instruction sets may round differently in the
// last bits (fused multiply-adds, the exp polynomial); each is row-independent on its own.
// It does not mask other than by the window, take more than one query position per row, or read
// bfloat16 caches.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "isa.h"
#include "vexp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
namespace attention {  // named, so that all.cpp can include every source in one unit

// Floats per vector: the instruction set's own register width, so that every vector operation,
// shuffles included, is one instruction (AVX2 lowers 16-float shuffles badly).  The width fixes
// the order of the sums, so the avx2 build rounds differently from the others.
#if defined(DS4_ISA_AVX2)
constexpr int W = 8;
#elif defined(DS4_ISA_AVX512) || defined(DS4_ISA_AMX)
constexpr int W = 16;
#else
constexpr int W = 4;  // the portable build: NEON's and SSE2's 128-bit registers
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }

// float16 caches: W values widened to float32, and float32 rounded to nearest even on store.
inline vf load(const at::Half* p) {
#if defined(__AVX512F__)
  static_assert(W == 16);
  __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  vf r;
  std::memcpy(&r, &v, sizeof r);
  return r;
#elif defined(__F16C__) && defined(DS4_ISA_AVX2)
  static_assert(W == 8);
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  vf r;
  std::memcpy(&r, &v, sizeof r);
  return r;
#else
  vf r;
  for (int i = 0; i < W; ++i) r[i] = static_cast<float>(p[i]);
  return r;
#endif
}

inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(at::Half* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<at::Half>(src[i]);
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }

// *p in every lane.  AVX2 broadcasts it from memory in one instruction, where splat's zero
// addition takes two: it counts in the weighted sums' inner loops.
inline vf splat_from(const float* p) {
#if defined(DS4_ISA_AVX2)
  const __m256 v = _mm256_broadcast_ss(p);
  vf r;
  std::memcpy(&r, &v, sizeof r);
  return r;
#else
  return splat(*p);
#endif
}

#if !defined(DS4_ISA_AVX2) && !defined(DS4_ISA_AVX512) && !defined(DS4_ISA_AMX)
inline float hsum(vf v) { return (v[0] + v[2]) + (v[1] + v[3]); }

// r[j] = sum of a[j]'s lanes for j < 4, by a fixed tree of pairwise lane additions.
inline vf transpose_sum(vf* a) {
  vf b[2];
  for (int j = 0; j < 2; ++j)
    b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 4, 5) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 2, 3, 6, 7);
  return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6) + __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7);
}
#elif defined(DS4_ISA_AVX2)
inline float hsum(vf v) {
  vf4 b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// r[j] = sum of a[j]'s lanes for j < 8, by a fixed tree of pairwise lane additions.
inline vf transpose_sum(vf* a) {
  vf b[4], c[2];
  for (int j = 0; j < 4; ++j)
    b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int j = 0; j < 2; ++j)
    c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(b[2 * j], b[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#else
inline float hsum(vf v) {
  vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// r[j] = sum of a[j]'s lanes for j < 16, by a fixed tree of pairwise lane additions.
inline vf transpose_sum(vf* a) {
  vf b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)
    b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)
    c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    d[j] = __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * j], c[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#endif

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// exp(x) for x <= 0: the scores minus their maximum (vexp.h).
inline vf vexp(vf x) { return ds4_math::exp_nonpositive<vf, vi>(x); }

template <typename T>
struct Job {
  const float* q;      // G * D query values of this kv head's group
  const float* new_k;  // D values to store as key len - 1 (null: already stored)
  const float* new_v;
  T* k;                // the cache's slot 0: key l at slot (slot + l) % cap, l < len <= cap
  T* v;
  float* out;          // G * D normalised outputs; null: a span's partial result instead
  int64_t len;
  float* partial;      // with out null: G maxima, G softmax denominators, G * D unnormalised sums
  int64_t slot;        // key 0's
  int64_t cap;
};

// Rows longer than one span attend span by span (keys [0, S), [S, 2S), ... counted from the row's
// first key) as separate jobs, each with its own maximum and denominator, merged in span order by
// `merge_spans`: so that the kv heads of one decoding row are work for every thread.  The spans
// follow from the row's length alone, and a row of at most S keys is one span, computed as before
// spans existed.
constexpr int64_t S = 512;

inline int64_t spans_of(int64_t len) { return (len + S - 1) / S; }

// Rows of a float32 cache are read in place; float16 rows are widened once per block into
// `tmp`, so that each of the group's queries does not widen them again.
inline const float* as_float(const float* src, int64_t, float*) { return src; }
inline const float* as_float(const at::Half* src, int64_t n, float* tmp) {
  for (int64_t i = 0; i < n; i += W) store(tmp + i, load(src + i));
  return tmp;
}
inline void copy_rows(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void copy_rows(float* dst, const at::Half* src, int64_t n) { as_float(src, n, dst); }

// Keys (or values) l0 .. l0 + n - 1 of a job as float32 rows.  A block that straddles the ring's
// wrap is gathered into `tmp`, so that the loops that read it see one run of rows as for any
// other block: where the wrap falls changes no arithmetic.
template <typename T>
inline const float* rows(const T* base, int64_t slot, int64_t cap, int64_t l0, int64_t n, int64_t D, float* tmp) {
  const int64_t a = slot + l0;  // < 2 cap
  if (a >= cap) return as_float(base + (a - cap) * D, n * D, tmp);
  if (a + n <= cap) return as_float(base + a * D, n * D, tmp);
  const int64_t n1 = cap - a;
  copy_rows(tmp, base + a * D, n1 * D);
  copy_rows(tmp + n1 * D, base, (n - n1) * D);
  return tmp;
}

// tanh(x) within 2 ulp: below |x| = 0.625, where 1 - e would cancel, Cephes' tanhf odd
// polynomial; above, (1 - e) / (1 + e) with e = exp(-2 |x|) <= 0.29.
inline vf vtanh(vf x) {
  const vf zero{};
  const vf a = x < zero ? -x : x;
  const vf e = vexp(a * -2.0f);
  const vf big = (1.0f - e) / (1.0f + e);
  const vf z = a * a;
  vf p = splat(-5.70498872745e-3f);
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const vf small = p * z * a + a;
  const vf t = a < splat(0.625f) ? small : big;
  return x < zero ? -t : t;
}

inline vf soft_cap(vf s, float cap) { return cap * vtanh(s / cap); }

// Scores [0, len) of a row capped in place; the padding lanes past len keep their -1e30, so
// that they still vanish in the softmax (capped they would be -cap, a real weight).
inline void soft_cap_row(float* s, int64_t len, float cap) {
  int64_t l = 0;
  for (; l + W <= len; l += W) store(s + l, soft_cap(load(s + l), cap));
  if (l < len) {
    const vf x = load(s + l);
    vf c = soft_cap(x, cap);
    for (int64_t j = len - l; j < W; ++j) c[j] = x[j];
    store(s + l, c);
  }
}

// Vectors of vf are 64-byte aligned, so that no vector load or store splits a cache line.
struct Scratch {
  std::vector<vf> scores;  // G rows of Lp floats
  std::vector<vf> qacc;    // the group's queries, then its output accumulators
  std::vector<vf> tmp;     // one widened or gathered block of keys or values
  std::vector<float> inv;  // 1 / softmax denominator per query
  std::vector<float> max;  // the scores' maximum per query
  std::vector<float> total;  // softmax denominator per query
};

constexpr int64_t KB = W;   // keys per score block: one transposing reduction
constexpr int64_t VB = 32;  // values per block of the weighted sum
constexpr int REGISTERS = W == 16 ? 32 : 16;  // vector registers: AVX512 has 32, AVX2 and SSE2 16

// The largest part of nv vectors, at most `most`, that divides it.
constexpr int part_of(int nv, int most) {
  int p = most < nv ? most : nv;
  while (nv % p != 0) --p;
  return p;
}

// Vectors of the head dim that two queries' weighted sums take at a time: all NV where their
// 2 NV accumulators leave registers for the operands, else halves; past 128 floats, whatever
// part fits, as halves would still spill.  A part only groups output lanes, each of which sums
// its own terms in key order, so the parts change no result.
template <int NV>
constexpr int pair_part() {
  if (NV * W > 128) return part_of(NV, (REGISTERS - 4) / 2);
  return 2 * NV + 4 <= REGISTERS || NV % 2 != 0 ? NV : NV / 2;
}

// The same for a group's last query, when it has no pair: all NV up to 128 floats.
template <int NV>
constexpr int single_part() { return NV * W > 128 ? part_of(NV, REGISTERS - 4) : NV; }

// One (row, kv head): store the new key and value, scores, softmax, weighted sum of values.
template <int NV, typename T>
void attend(const Job<T>& job, int64_t G, float scale, float softcap, Scratch& sc) {
  constexpr int D = NV * W, NP = pair_part<NV>(), NS = single_part<NV>();
  const int64_t L = job.len, Lp = (L + W - 1) / W * W;
  if (job.new_k != nullptr) {
    const int64_t last = (job.slot + L - 1) % job.cap;
    store_row(job.k + last * D, job.new_k, D);
    store_row(job.v + last * D, job.new_v, D);
  }
  sc.scores.resize(G * Lp / W);
  sc.qacc.resize(G * NV);
  sc.tmp.resize(VB * NV);
  float* s = reinterpret_cast<float*>(sc.scores.data());
  float* tmp = reinterpret_cast<float*>(sc.tmp.data());
  vf* q = sc.qacc.data();
  for (int64_t i = 0; i < G * NV; ++i) q[i] = load(job.q + i * W) * scale;
  for (int64_t l0 = 0; l0 < L; l0 += KB) {
    const int64_t n = L - l0 < KB ? L - l0 : KB;
    const float* kb = rows(job.k, job.slot, job.cap, l0, n, D, tmp);
    // KB keys' partial dot products, then one transposing reduction per query: a key's score
    // is the same fixed sum of its lanes wherever it sits in a block.  A query stays in
    // registers while four keys' products, independent chains, are summed side by side.
    for (int64_t g = 0; g < G; ++g) {
      vf qg[NV];
      for (int c = 0; c < NV; ++c) qg[c] = q[g * NV + c];
      vf acc[KB];
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        const float* k = kb + j * D;
        vf a[4];
        for (int i = 0; i < 4; ++i) a[i] = qg[0] * load(k + i * D);
        for (int c = 1; c < NV; ++c)
          for (int i = 0; i < 4; ++i) a[i] += qg[c] * load(k + i * D + c * W);
        for (int i = 0; i < 4; ++i) acc[j + i] = a[i];
      }
      for (; j < n; ++j) {
        vf a = qg[0] * load(kb + j * D);
        for (int c = 1; c < NV; ++c) a += qg[c] * load(kb + j * D + c * W);
        acc[j] = a;
      }
      for (; j < KB; ++j) acc[j] = splat(-1e30f / W);
      store(s + g * Lp + l0, transpose_sum(acc));
    }
  }
  if (softcap > 0)
    for (int64_t g = 0; g < G; ++g) soft_cap_row(s + g * Lp, L, softcap);
  sc.inv.resize(G);
  sc.max.resize(G);
  sc.total.resize(G);
  float* inv = sc.inv.data();
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * Lp;
    vf m = load(sg);
    for (int64_t l = W; l < Lp; l += W) { vf x = load(sg + l); m = x > m ? x : m; }
    sc.max[g] = hmax(m);
    const vf mx = splat(sc.max[g]);
    vf sum{};
    for (int64_t l = 0; l < Lp; l += W) {
      vf e = vexp(load(sg + l) - mx);
      store(sg + l, e);
      if (l + W <= L) sum += e;
    }
    float total = hsum(sum);
    for (int64_t l = L / W * W; l < L; ++l) total += sg[l];
    sc.total[g] = total;
    inv[g] = 1.0f / total;
  }
  // Weighted values, a block at a time, two queries per pass over it (over a part of the head
  // dim at a time where both queries' accumulators would not fit in registers); each output
  // lane sums its terms in key order.
  vf* acc = q;  // the queries are no longer needed
  for (int64_t i = 0; i < G * NV; ++i) acc[i] = vf{};
  for (int64_t l0 = 0; l0 < L; l0 += VB) {
    const int64_t n = L - l0 < VB ? L - l0 : VB;
    const float* vb = rows(job.v, job.slot, job.cap, l0, n, D, tmp);
    int64_t g = 0;
    for (; g + 1 < G; g += 2) {
      for (int c0 = 0; c0 < NV; c0 += NP) {
        vf a[NP], b[NP];
        for (int c = 0; c < NP; ++c) a[c] = acc[g * NV + c0 + c], b[c] = acc[(g + 1) * NV + c0 + c];
        const float* pa = s + g * Lp + l0;
        const float* pb = pa + Lp;
        for (int64_t j = 0; j < n; ++j) {
          const vf wa = splat_from(pa + j), wb = splat_from(pb + j);
          for (int c = 0; c < NP; ++c) {
            const vf x = load(vb + j * D + (c0 + c) * W);
            a[c] += wa * x;
            b[c] += wb * x;
          }
        }
        for (int c = 0; c < NP; ++c) acc[g * NV + c0 + c] = a[c], acc[(g + 1) * NV + c0 + c] = b[c];
      }
    }
    if (g < G) {
      for (int c0 = 0; c0 < NV; c0 += NS) {
        vf a[NS];
        for (int c = 0; c < NS; ++c) a[c] = acc[g * NV + c0 + c];
        const float* pa = s + g * Lp + l0;
        for (int64_t j = 0; j < n; ++j) {
          const vf wa = splat_from(pa + j);
          for (int c = 0; c < NS; ++c) a[c] += wa * load(vb + j * D + (c0 + c) * W);
        }
        for (int c = 0; c < NS; ++c) acc[g * NV + c0 + c] = a[c];
      }
    }
  }
  if (job.out != nullptr) {
    for (int64_t g = 0; g < G; ++g)
      for (int c = 0; c < NV; ++c) store(job.out + g * D + c * W, acc[g * NV + c] * inv[g]);
    return;
  }
  float* p = job.partial;
  for (int64_t g = 0; g < G; ++g) p[g] = sc.max[g], p[G + g] = sc.total[g];
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) store(p + 2 * G + g * D + c * W, acc[g * NV + c]);
}

// One row's spans, partial results [n][2 G + G D] in span order, into G * D outputs: each
// span's sums scaled by exp(its maximum - the overall maximum), added in span order.
inline void merge_spans(const float* partials, int64_t n, int64_t G, int64_t D, float* out) {
  const int64_t stride = 2 * G + G * D;
  for (int64_t g = 0; g < G; ++g) {
    float m = partials[g];
    for (int64_t i = 1; i < n; ++i) m = partials[i * stride + g] > m ? partials[i * stride + g] : m;
    float total = 0.0f;
    std::vector<float> f(n);
    for (int64_t i = 0; i < n; ++i) {
      f[i] = vexp(splat(partials[i * stride + g] - m))[0];
      total += partials[i * stride + G + g] * f[i];
    }
    const vf inv = splat(1.0f / total);
    for (int64_t c = 0; c < D; c += W) {
      vf acc{};
      for (int64_t i = 0; i < n; ++i) acc += load(partials + i * stride + 2 * G + g * D + c) * f[i];
      store(out + g * D + c, acc * inv);
    }
  }
}

// Vectors of 16 floats, the head dim's granule: only its multiples are instantiated.
constexpr int NV16 = 16 / W;

// attend<nv> for the head dim's nv vectors (nv a multiple of NV16, at most NV).
template <int NV, typename T>
void attend_width(int64_t nv, const Job<T>& job, int64_t G, float scale, float softcap, Scratch& sc) {
  if (nv == NV) {
    attend<NV>(job, G, scale, softcap, sc);
  } else if constexpr (NV > NV16) {
    attend_width<NV - NV16>(nv, job, G, scale, softcap, sc);
  }
}

// The jobs, a row longer than one span split into one job per span (the new key and value
// stored by the span that holds their position), then the split rows merged.
template <typename T>
void run_jobs(const std::vector<Job<T>>& jobs, int64_t G, int64_t D, float scale, float softcap) {
  std::vector<Job<T>> work;
  std::vector<int64_t> first;  // per split job: its first span's index in `work`
  int64_t n_partial = 0;
  for (const Job<T>& job : jobs) n_partial += spans_of(job.len) > 1 ? spans_of(job.len) : 0;
  std::vector<float> partials(n_partial * (2 * G + G * D));
  float* next = partials.data();
  for (const Job<T>& job : jobs) {
    const int64_t n = spans_of(job.len);
    if (n == 1) {
      work.push_back(job);
      continue;
    }
    first.push_back(static_cast<int64_t>(work.size()));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t begin = i * S, len = std::min(S, job.len - begin);
      const bool last = i == n - 1;
      work.push_back({job.q, last ? job.new_k : nullptr, last ? job.new_v : nullptr, job.k, job.v, nullptr, len,
                      next, (job.slot + begin) % job.cap, job.cap});
      next += 2 * G + G * D;
    }
  }
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t j = begin; j < end; ++j) {
      attend_width<256 / W>(D / W, work[j], G, scale, softcap, scratch);
    }
  });
  std::vector<const Job<T>*> split;
  for (const Job<T>& job : jobs)
    if (spans_of(job.len) > 1) split.push_back(&job);
  at::parallel_for(0, static_cast<int64_t>(split.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      merge_spans(work[first[i]].partial, spans_of(split[i]->len), G, D, split[i]->out);
  });
}

// The first position a query at p attends.
inline int64_t first_key(int64_t p, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, p + 1 - window) : 0;
}

template <typename T>
void run(const at::Tensor& qkv, at::TensorList kv, at::IntArrayRef positions, float scale, int64_t window,
         float softcap, int64_t H, int64_t Hkv, int64_t D, at::Tensor& out) {
  const int64_t N = qkv.size(0), G = H / Hkv;
  const float* const q0 = qkv.data_ptr<float>();
  float* const out0 = out.data_ptr<float>();
  std::vector<Job<T>> jobs;
  jobs.reserve(N * Hkv);
  for (int64_t i = 0; i < N; ++i) {
    const at::Tensor& t = kv[i];
    TORCH_CHECK(t.dim() == 4 && t.size(0) == 2 && t.size(1) == Hkv && t.size(3) == D &&
                    t.scalar_type() == kv[0].scalar_type() && t.stride(3) == 1 && t.stride(2) == D,
                "decode_attention: cache ", i, " must be [2, Hkv, capacity, D] like cache 0");
    const int64_t p = positions[i], lo = first_key(p, window), cap = t.size(2);
    TORCH_CHECK(p >= 0 && p - lo < cap, "decode_attention: position ", p, " (attending ", lo, " .. ", p,
                ") is outside cache ", i, " of capacity ", cap);
    T* base = t.data_ptr<T>();
    const float* row = q0 + i * qkv.stride(0);
    for (int64_t h = 0; h < Hkv; ++h)
      jobs.push_back({row + h * G * D, row + (H + h) * D, row + (H + Hkv + h) * D, base + h * t.stride(1),
                      base + t.stride(0) + h * t.stride(1), out0 + i * H * D + h * G * D, p - lo + 1, nullptr,
                      lo % cap, cap});
  }
  run_jobs(jobs, G, D, scale, softcap);
}

// The head dim, window and softcap, checked alike for both ops.
inline void check_shape(const char* op, int64_t D, int64_t window, double softcap) {
  TORCH_CHECK(D > 0 && D % 16 == 0 && D <= 256, op, ": head dim must be a multiple of 16 up to 256, not ", D);
  TORCH_CHECK(window >= 0, op, ": window must be >= 0 (0: none), not ", window);
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), op, ": softcap must be finite and >= 0 (0: none), not ",
              softcap);
}

DS4_ENTRY at::Tensor decode_attention(const at::Tensor& qkv, at::TensorList kv, at::IntArrayRef positions,
                                      double scale, int64_t window, double softcap) {
  const int64_t N = qkv.size(0);
  TORCH_CHECK(N > 0 && static_cast<int64_t>(kv.size()) == N && static_cast<int64_t>(positions.size()) == N,
              "decode_attention: needs rows, and one cache and one position per row");
  const int64_t Hkv = kv[0].size(1), D = kv[0].size(3);
  check_shape("decode_attention", D, window, softcap);
  const int64_t H = qkv.size(1) / D - 2 * Hkv;
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1,
              "decode_attention: qkv must be [N, (H + 2 Hkv) D] float32 with contiguous rows");
  TORCH_CHECK((H + 2 * Hkv) * D == qkv.size(1) && H >= Hkv && H % Hkv == 0,
              "decode_attention: qkv's width does not fit the caches' heads");
  at::Tensor out = at::empty({N, H * D}, qkv.options());
  const float s = static_cast<float>(scale), c = static_cast<float>(softcap);
  switch (kv[0].scalar_type()) {
    case at::kFloat: run<float>(qkv, kv, positions, s, window, c, H, Hkv, D, out); break;
    case at::kHalf: run<at::Half>(qkv, kv, positions, s, window, c, H, Hkv, D, out); break;
    default: TORCH_CHECK(false, "decode_attention: caches must be float32 or float16, not ", kv[0].scalar_type());
  }
  return out;
}

// Rows start .. start + q.size(0) - 1 against a cache whose position p is at slot
// (p - origin) % capacity.
template <typename T>
void run_prefill(const at::Tensor& q, const at::Tensor& kv, int64_t start, int64_t origin, float scale,
                 int64_t window, float softcap, int64_t H, int64_t Hkv, int64_t D, at::Tensor& out) {
  const int64_t N = q.size(0), G = H / Hkv, cap = kv.size(2);
  const float* const q0 = q.data_ptr<float>();
  float* const out0 = out.data_ptr<float>();
  T* base = kv.data_ptr<T>();
  std::vector<Job<T>> jobs;
  jobs.reserve(N * Hkv);
  // Head by head: consecutive jobs read the same keys and values, which stay in cache.
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t i = 0; i < N; ++i) {
      const int64_t p = start + i, lo = first_key(p, window);
      jobs.push_back({q0 + i * q.stride(0) + h * G * D, nullptr, nullptr, base + h * kv.stride(1),
                      base + kv.stride(0) + h * kv.stride(1), out0 + i * H * D + h * G * D, p - lo + 1, nullptr,
                      (lo - origin) % cap, cap});
    }
  run_jobs(jobs, G, D, scale, softcap);
}

// A float16 cache is widened once for the whole chunk (exactly), so that its rows, which all
// read the same keys, do not each widen them again; then the float32 jobs run on the copy, which
// holds the chunk's keys in position order from the first row's first key.
template <>
void run_prefill<at::Half>(const at::Tensor& q, const at::Tensor& kv, int64_t start, int64_t origin, float scale,
                           int64_t window, float softcap, int64_t H, int64_t Hkv, int64_t D, at::Tensor& out) {
  const int64_t lo = first_key(start, window), L = start + q.size(0) - lo, cap = kv.size(2);
  const int64_t a = (lo - origin) % cap, n1 = std::min(L, cap - a);  // the ring wraps after n1 positions
  at::Tensor wide = at::empty({2, Hkv, L, D}, q.options());
  const at::Half* src = kv.data_ptr<at::Half>();
  float* dst = wide.data_ptr<float>();
  at::parallel_for(0, 2 * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const at::Half* from = src + (i / Hkv) * kv.stride(0) + (i % Hkv) * kv.stride(1);
      float* to = dst + i * L * D;
      for (int64_t j = 0; j < n1 * D; j += W) store(to + j, load(from + a * D + j));
      for (int64_t j = n1 * D; j < L * D; j += W) store(to + j, load(from + j - n1 * D));
    }
  });
  run_prefill<float>(q, wide, start, lo, scale, window, softcap, H, Hkv, D, out);
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kv, int64_t start, double scale,
                             int64_t window, double softcap) {
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.stride(3) == 1 && kv.stride(2) == kv.size(3),
              "prefill_attention: the cache must be [2, Hkv, capacity, D] with contiguous positions");
  const int64_t Hkv = kv.size(1), D = kv.size(3), N = q.size(0);
  check_shape("prefill_attention", D, window, softcap);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.stride(1) == 1 && q.size(1) % D == 0,
              "prefill_attention: q must be [T, H D] float32 with contiguous rows");
  const int64_t H = q.size(1) / D;
  TORCH_CHECK(H >= Hkv && H % Hkv == 0, "prefill_attention: q's heads do not fit the cache's");
  // Every row's keys at once: from the first row's first key to the last row's position.
  const int64_t lo = first_key(start, window);
  TORCH_CHECK(start >= 0 && start + N - lo <= kv.size(2), "prefill_attention: positions ", start, " .. ", start + N,
              " (attending from ", lo, ") are outside the cache of capacity ", kv.size(2));
  at::Tensor out = at::empty({N, H * D}, q.options());
  if (N == 0) return out;
  const float s = static_cast<float>(scale), c = static_cast<float>(softcap);
  switch (kv.scalar_type()) {
    case at::kFloat: run_prefill<float>(q, kv, start, 0, s, window, c, H, Hkv, D, out); break;
    case at::kHalf: run_prefill<at::Half>(q, kv, start, 0, s, window, c, H, Hkv, D, out); break;
    default: TORCH_CHECK(false, "prefill_attention: the cache must be float32 or float16, not ", kv.scalar_type());
  }
  return out;
}

// Scores capped as attention caps them (softcap tanh(s / softcap)): exposed for testing the tanh.
at::Tensor attention_softcap(const at::Tensor& scores, double softcap) {
  TORCH_CHECK(scores.dim() == 1 && scores.scalar_type() == at::kFloat && scores.is_contiguous() && softcap > 0,
              "attention_softcap: needs contiguous float32 [n] scores and softcap > 0");
  const int64_t n = scores.size(0), np = (n + W - 1) / W * W;
  std::vector<vf> buf(np / W);
  float* b = reinterpret_cast<float*>(buf.data());
  std::memcpy(b, scores.data_ptr<float>(), n * sizeof(float));
  soft_cap_row(b, n, static_cast<float>(softcap));
  at::Tensor out = at::empty({n}, scores.options());
  std::memcpy(out.data_ptr<float>(), b, n * sizeof(float));
  return out;
}

}  // namespace attention
}  // namespace

TORCH_LIBRARY_FRAGMENT(ds4, m) {
  m.def(DS4_OP("decode_attention") "(Tensor qkv, Tensor(a!)[] kv, int[] positions, float scale, int window=0, "
                                   "float softcap=0.0) -> Tensor");
  m.def(DS4_OP("prefill_attention") "(Tensor q, Tensor kv, int start, float scale, int window=0, "
                                    "float softcap=0.0) -> Tensor");
  m.def(DS4_OP("attention_softcap") "(Tensor scores, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(ds4, CPU, m) {
  m.impl(DS4_OP("decode_attention"), &attention::decode_attention);
  m.impl(DS4_OP("prefill_attention"), &attention::prefill_attention);
  m.impl(DS4_OP("attention_softcap"), &attention::attention_softcap);
}
