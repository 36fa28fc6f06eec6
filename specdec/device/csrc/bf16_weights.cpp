// x @ W^T for float32 activations and bfloat16-stored weights, computed in float32.
//
// A bfloat16 is the upper half of a float32, so widening a weight is exact: on a model whose
// checkpoint is bfloat16 this is the float32 model, reading half the bytes. Every output
// element is one dot product over k in a fixed order (eight float32 lanes, fused multiply-adds
// along k, then a fixed reduction of the lanes), whatever the number of rows, the blocking or the
// thread that computes it: a row's result does not depend on the width of the call.
//
// The weight comes packed (specdec.device.bf16_weights.pack): [ceil(N / 2), ceil(K / 16), 2, 16],
// zero-padded, so that each pair of output rows is one contiguous stream, chunk by chunk. A call
// of a few rows is bound by reading the weight, and one sequential stream per thread is what the
// hardware prefetcher follows best: on the 2-core AVX2-emulating EPYC (a standalone C++ timing
// loop, not in the repository), pairs of rows read 0.39 ms for an 8960 x 1536 one-row call where
// four separate rows read 0.58 (a plain read of the same bytes: 0.36); two or four streams per
// thread were slower than one.
//
// Built on first use by torch.utils.cpp_extension (specdec.device.bf16_weights), for x86-64 with
// AVX2 and FMA, into torch.ops.specdec.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kChunk = 16;  // k values one step of the inner loop consumes
constexpr int kPair = 2;        // output rows per packed block
constexpr int kMaxRows = 4;     // activation rows per pass over a block (14 of 16 registers)
// Weights are prefetched this many values ahead in the block stream (8 KiB): in the same timing
// loop, on that EPYC only, 2048 and 4096 were near-best for the 8960 x 1536 and 1536 x 8960
// projections from 1 to 8 rows, 1024 lost 10-60% from 2 rows on.
constexpr int64_t kPrefetch = 4096;

inline float reduce_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MB activation rows against one block (two output rows). Sixteen bfloat16 weights load as eight
// 32-bit words: the even ones widen by a shift, the odd ones by masking the low half, so x is
// stored in the same even/odd order (split_even_odd). Each weight is widened once per pass and
// used by every row of the pass. Inlined by force, as is block_rows: when GCC kept them out of
// line (once block_rows had a second caller), 1- and 17-row calls took 15-27% longer.
template <int MB>
__attribute__((always_inline)) inline void tile(const float* x, const uint16_t* block, float* y,
                                                int64_t chunks, int64_t Kp, int64_t N,
                                                int outputs) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[MB][kPair];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < kPair; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* w = block + c * kPair * kChunk;
    // a prefetch past the end of the weight is harmless: prefetches never fault
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
    __m256 even[kPair], odd[kPair];
    for (int n = 0; n < kPair; ++n) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * kChunk));
      even[n] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      odd[n] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    }
    const int64_t k = c * kChunk;
    for (int m = 0; m < MB; ++m) {
      const __m256 xe = _mm256_loadu_ps(x + m * Kp + k), xo = _mm256_loadu_ps(x + m * Kp + k + 8);
      for (int n = 0; n < kPair; ++n) {
        acc[m][n] = _mm256_fmadd_ps(xe, even[n], acc[m][n]);
        acc[m][n] = _mm256_fmadd_ps(xo, odd[n], acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < outputs; ++n) y[m * N + n] = reduce_lanes(acc[m][n]);
}

// Every row of x against one block, in the fewest passes of at most kMaxRows rows, as even as
// possible (5 rows as 3 + 2 took 0.92 ms where 4 + 1 took 1.00 on an 8960 x 1536 call): the first
// pass reads the block from memory, later ones from cache.
__attribute__((always_inline)) inline void block_rows(const float* x, const uint16_t* block,
                                                      float* y, int64_t M, int64_t chunks,
                                                      int64_t Kp, int64_t N, int outputs) {
  int64_t m = 0;
  for (int64_t passes = (M + kMaxRows - 1) / kMaxRows; passes > 0; --passes) {
    const int64_t rows = (M - m + passes - 1) / passes;
    const float* xr = x + m * Kp;
    float* yr = y + m * N;
    switch (rows) {
      case 1: tile<1>(xr, block, yr, chunks, Kp, N, outputs); break;
      case 2: tile<2>(xr, block, yr, chunks, Kp, N, outputs); break;
      case 3: tile<3>(xr, block, yr, chunks, Kp, N, outputs); break;
      default: tile<kMaxRows>(xr, block, yr, chunks, Kp, N, outputs);
    }
    m += rows;
  }
}

// A call of many rows (a prefill) goes over panels of blocks instead, each panel at most
// kPanelBytes of weight, that stays in cache while every pass of rows goes over it: each row is
// then read once a panel rather than once a block. On the 2-core AVX2-only EPYC (both builds
// loaded in one process, timed alternately, 2026-12-07), 700 rows took 0.46-0.63x the
// block-by-block loop's time for a 1536 x 8960 weight and 0.75-0.81x for 8960 x 1536, 64 rows
// 0.92-0.99x. Blocking changes which values are in cache, never the order of any output's
// arithmetic. Verify widths (up to 17 rows) keep the block-by-block loop.
constexpr int64_t kPanelMinRows = 33;
constexpr int64_t kPanelBytes = 256 * 1024;

void panel_rows(const float* x, const uint16_t* w, float* y, int64_t M, int64_t chunks,
                int64_t Kp, int64_t N, int64_t b0, int64_t b1) {
  int64_t m = 0;
  for (int64_t passes = (M + kMaxRows - 1) / kMaxRows; passes > 0; --passes) {
    const int64_t rows = (M - m + passes - 1) / passes;
    for (int64_t b = b0; b < b1; ++b) {
      const int outputs = static_cast<int>(std::min<int64_t>(kPair, N - b * kPair));
      block_rows(x + m * Kp, w + b * kPair * Kp, y + m * N + b * kPair, rows, chunks, Kp, N,
                 outputs);
    }
    m += rows;
  }
}

// Rows of x, zero-padded to Kp values, with each 16-value chunk reordered to
// [x0 x2 .. x14 | x1 x3 .. x15] to match the widened weights.
at::Tensor split_even_odd(const at::Tensor& x, int64_t Kp) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor padded = x;
  if (Kp != K) padded = at::constant_pad_nd(x, {0, Kp - K});
  at::Tensor out = at::empty_like(padded);
  const float* src = padded.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < Kp; k += kChunk)
      for (int j = 0; j < kChunk / 2; ++j) {
        dst[m * Kp + k + j] = src[m * Kp + k + 2 * j];
        dst[m * Kp + k + kChunk / 2 + j] = src[m * Kp + k + 2 * j + 1];
      }
  return out;
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, "linear_bf16w: input must be float32, got ",
              input.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == kPair && packed.size(3) == kChunk,
              "linear_bf16w: weight must be packed by bf16_weights.pack, a bfloat16 tensor "
              "[ceil(out / 2), ceil(in / 16), 2, 16]");
  const int64_t N = out_features, K = input.size(-1), chunks = packed.size(1), Kp = chunks * kChunk;
  TORCH_CHECK(packed.size(0) == (N + 1) / kPair, "linear_bf16w: the packed weight holds ",
              packed.size(0) * kPair, " outputs, not ", N);
  TORCH_CHECK(Kp - kChunk < K && K <= Kp, "linear_bf16w: input has ", K,
              " features, the packed weight takes ", Kp - kChunk + 1, " to ", Kp);
  const at::Tensor bias_f = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!bias_f.defined() || (bias_f.scalar_type() == at::kFloat && bias_f.numel() == N),
              "linear_bf16w: bias must be float32 with ", N, " values");
  const at::Tensor x2 = input.reshape({-1, K}).contiguous();
  const at::Tensor w = packed.contiguous();
  const int64_t M = x2.size(0);
  const at::Tensor xs = split_even_odd(x2, Kp);
  at::Tensor y = at::empty({M, N}, x2.options());
  const float* xp = xs.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t blocks = packed.size(0);
  if (M < kPanelMinRows) {
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int outputs = static_cast<int>(std::min<int64_t>(kPair, N - b * kPair));
        block_rows(xp, wp + b * kPair * Kp, yp + b * kPair, M, chunks, Kp, N, outputs);
      }
    });
  } else {
    const int64_t panel = std::max<int64_t>(1, kPanelBytes / (kPair * Kp * 2));
    at::parallel_for(0, blocks, panel, [&](int64_t b0, int64_t b1) {
      for (int64_t p = b0; p < b1; p += panel)
        panel_rows(xp, wp, yp, M, chunks, Kp, N, p, std::min(b1, p + panel));
    });
  }
  if (bias_f.defined()) y.add_(bias_f);
  auto shape = input.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

bool cpu_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("linear_bf16w(Tensor input, Tensor packed, int out_features, Tensor? bias=None) -> Tensor",
        &linear);
  m.def("bf16w_cpu_supported() -> bool", &cpu_supported);
}
