// x @ W^T for float32 activations and bfloat16-stored weights, computed in float32.
//
// A bfloat16 is the upper half of a float32, so widening a weight is exact: on a model whose
// checkpoint is bfloat16 this is the float32 model, reading half the bytes. Every output
// element is one dot product over k in a fixed order (eight float32 lanes, fused multiply-adds
// along k, then a fixed reduction of the lanes), whatever the number of rows, the blocking or the
// thread that computes it: a row's result does not depend on the width of the call.
//
// Built on first use by torch.utils.cpp_extension (specdec.models.bf16_weights), for x86-64 with
// AVX2 and FMA, into torch.ops.specdec.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kChunk = 16;  // k values one step of the inner loop consumes
constexpr int kRowsN = 4;       // weight rows (outputs) per tile
constexpr int kRowsM = 2;       // activation rows per tile in calls of more than 4 rows
// Weights are prefetched this many values ahead of the loads: on the 2-core AVX2-emulating EPYC
// it cut a 4-row call of Qwen2.5-1.5B's 8960 x 1536 projection from 1.30 ms to 0.85 (256
// values ahead: 0.83, 1024: 0.95; the 1536 x 8960 one preferred 1024, 512 was near both bests).
constexpr int64_t kPrefetch = 512;

inline float reduce_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sixteen bfloat16 weights load as eight 32-bit words: the even ones widen by a shift, the odd
// ones by masking the low half, so x is stored in the same even/odd order (split_even_odd).
template <int NB, int MB>
inline void tile(const float* x, const uint16_t* w, float* y, int64_t k_chunks, int64_t K,
                 int64_t N) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k_chunks; ++c) {
    const int64_t k = c * kChunk;
    for (int n = 0; n < NB; ++n) {
      // a prefetch past the end of the weight is harmless: prefetches never fault
      _mm_prefetch(reinterpret_cast<const char*>(w + n * K + k + kPrefetch), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * K + k));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      for (int m = 0; m < MB; ++m) {
        acc[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), even, acc[m][n]);
        acc[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), odd, acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) y[m * N + n] = reduce_lanes(acc[m][n]);
}

// Rows of x with each 16-value chunk reordered to [x0 x2 .. x14 | x1 x3 .. x15]; the tail past
// the last whole chunk is copied as it is.
at::Tensor split_even_odd(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), whole = K / kChunk * kChunk;
  at::Tensor out = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* s = src + m * K;
    float* d = dst + m * K;
    for (int64_t k = 0; k < whole; k += kChunk)
      for (int j = 0; j < kChunk / 2; ++j) {
        d[k + j] = s[k + 2 * j];
        d[k + kChunk / 2 + j] = s[k + 2 * j + 1];
      }
    for (int64_t k = whole; k < K; ++k) d[k] = s[k];
  }
  return out;
}

// All M rows against NB weight rows: a verify's 1-4 rows in one pass over the weights (4-row
// tiles past that spilled registers: 8-17 rows ran 10-25% slower), more rows kRowsM at a time
// (the tile then comes from cache after the first pass).
template <int NB>
inline void tile_column(const float* x, const uint16_t* w, float* y, int64_t M, int64_t k_chunks,
                        int64_t K, int64_t N) {
  switch (M) {
    case 1: return tile<NB, 1>(x, w, y, k_chunks, K, N);
    case 2: return tile<NB, 2>(x, w, y, k_chunks, K, N);
    case 3: return tile<NB, 3>(x, w, y, k_chunks, K, N);
    case 4: return tile<NB, 4>(x, w, y, k_chunks, K, N);
  }
  int64_t m = 0;
  for (; m + kRowsM <= M; m += kRowsM) tile<NB, kRowsM>(x + m * K, w, y + m * N, k_chunks, K, N);
  for (; m < M; ++m) tile<NB, 1>(x + m * K, w, y + m * N, k_chunks, K, N);
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, "linear_bf16w: input must be float32, got ",
              input.scalar_type());
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "linear_bf16w: weight must be a 2-D bfloat16 tensor");
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(input.size(-1) == K, "linear_bf16w: input has ", input.size(-1),
              " features, weight expects ", K);
  const at::Tensor bias_f = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!bias_f.defined() || (bias_f.scalar_type() == at::kFloat && bias_f.numel() == N),
              "linear_bf16w: bias must be float32 with ", N, " values");
  const at::Tensor x2 = input.reshape({-1, K}).contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t M = x2.size(0), k_chunks = K / kChunk;
  const at::Tensor xs = split_even_odd(x2);
  at::Tensor y = at::empty({M, N}, x2.options());
  const float* xp = xs.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / kRowsN;
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      tile_column<kRowsN>(xp, wp + b * kRowsN * K, yp + b * kRowsN, M, k_chunks, K, N);
  });
  for (int64_t n = blocks * kRowsN; n < N; ++n)
    tile_column<1>(xp, wp + n * K, yp + n, M, k_chunks, K, N);
  const int64_t whole = k_chunks * kChunk;
  if (whole < K || bias_f.defined()) {
    const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        float acc = yp[m * N + n];
        for (int64_t k = whole; k < K; ++k) {
          const uint32_t bits = static_cast<uint32_t>(wp[n * K + k]) << 16;
          float wk;
          std::memcpy(&wk, &bits, sizeof wk);
          acc = std::fma(xp[m * K + k], wk, acc);
        }
        yp[m * N + n] = b ? acc + b[n] : acc;
      }
  }
  auto shape = input.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

bool cpu_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("linear_bf16w(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor", &linear);
  m.def("bf16w_cpu_supported() -> bool", &cpu_supported);
}
