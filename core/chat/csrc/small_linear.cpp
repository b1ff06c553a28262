// Linear layers at the few rows of a decode step (core/chat/small_linear.py loads this file).
//
// y (M, N) = x (M, K) . w (N, K)^T [* scale (N)] [+ bias (N)] for M up to 8 rows (decode_stack.cpp's product() takes
// more: eight rows a pass, or torch's product for fp32 weights). At these sizes the product is
// a matter of reading the weight once, at the memory's rate: each weight row is read once for every row of x,
// converted to fp32 in registers (bf16: a shift; int8: a widening with the row's scale applied to the sum), and
// multiplied into fp32 sums; x itself, converted to fp32 once, stays in the first-level cache. Work is split over
// output columns. Every output element is one dot product whose terms are added in the same order whatever M is
// and however the columns are split, so a row computes the same bits alone as in a batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

static inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

static inline float weight_at(const uint16_t* w, int64_t k) { return bf16_to_float(w[k]); }
static inline float weight_at(const int8_t* w, int64_t k) { return static_cast<float>(w[k]); }
static inline float weight_at(const float* w, int64_t k) { return w[k]; }

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
#ifndef PREFETCH
#define PREFETCH 512
#endif
// Sixteen weights from p as fp32 (the first `n` of them; the rest zero).
static inline __m512 load16(const uint16_t* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const int8_t* p, __mmask16 m) {
  __m128i b = _mm_maskz_loadu_epi8(m, p);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t LANES = 8;
// Eight weights from p as fp32.
static inline __m256 load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 load8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
constexpr int ACC = 4;   // registers per output's sum (bench/README.md, "The small-row kernel on AVX2")
constexpr int RG = 4;    // rows of x per pass over a block's weight rows
#ifndef INT8_PREFETCH
#define INT8_PREFETCH 2048
#endif
// The last K % 8 weights or values of x (the rest of the lanes zero), through a buffer: the same lanes as a
// full load.
template <typename w_t>
static inline __m256 load_tail(const w_t* p, int64_t n) {
  alignas(32) float t[LANES] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t i = 0; i < n; ++i) t[i] = weight_at(p, i);
  return _mm256_load_ps(t);
}
// The eight lanes' sum, in a fixed order.
static inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

// Columns [n0, n1) of y for R rows of x (xf: fp32, R x K), NB weight rows at a time (independent sums keep
// several cache lines of the weight in flight).
template <int R, typename w_t>
static void columns(const float* xf, const w_t* w, int64_t K, int64_t n0, int64_t n1, float* acc_out) {
  constexpr int NB = R <= 2 ? 4 : (R <= 4 ? 2 : 1);   // R x NB sums: at most 8 registers
  int64_t n = n0;
#if defined(__AVX512F__)
  for (; n + NB <= n1; n += NB) {
    __m512 acc[R][NB];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
      const __mmask16 m = K - k >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j) {
        // the weight streams from memory: ask for it PREFETCH bytes ahead of the loads
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + j) * K + k) + PREFETCH, _MM_HINT_T0);
        wv[j] = load16(w + (n + j) * K + k, m);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, xf + r * K + k);
        for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) acc_out[r * (n1 - n0) + (n + j - n0)] = _mm512_reduce_add_ps(acc[r][j]);
  }
  for (; n < n1; ++n) {   // the last columns one at a time, with the same sums in the same order
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
      const __mmask16 m = K - k >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
      const __m512 wv = load16(w + n * K + k, m);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, xf + r * K + k), wv, acc[r]);
    }
    for (int r = 0; r < R; ++r) acc_out[r * (n1 - n0) + (n - n0)] = _mm512_reduce_add_ps(acc[r]);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // eight lanes; each output's sum in ACC registers (the row's 8-lane block b into register b % ACC), added in
  // a fixed order at the end, so that its terms meet in the same order whatever R is. One weight row at a time,
  // read straight through (several rows at once, as above, read at most two thirds as fast here: K = 768 rows
  // are short streams), its R x ACC independent sums hiding the FMA's latency; the last K % 8 terms go through
  // a zero-padded buffer. run() gives this at most RG rows at a time.
  static_assert(R <= RG, "AVX2 columns: at most RG rows at a time");
  const int64_t K8 = K - K % LANES;
  for (; n < n1; ++n) {
    const w_t* wr = w + n * K;
    __m256 acc[R][ACC];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < ACC; ++a) acc[r][a] = _mm256_setzero_ps();
    // the 8-lane block at k into register a (a loop over a constant range: the registers stay registers)
    auto block = [&](int64_t k, int a) {
      const __m256 wv = load8(wr + k);
      for (int r = 0; r < R; ++r) acc[r][a] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + r * K + k), wv, acc[r][a]);
    };
    int64_t k = 0;
    for (; k + ACC * LANES <= K8; k += ACC * LANES) {
      // int8 weights: ask for the stream INT8_PREFETCH bytes ahead (with the hardware's prefetcher alone an
      // int8 step took 10-15% longer; fp32 and bf16 weights gained nothing or lost: bench/README.md, "Prefetching
      // int8 weights on AVX2")
      if constexpr (sizeof(w_t) == 1)
        _mm_prefetch(reinterpret_cast<const char*>(wr + k) + INT8_PREFETCH, _MM_HINT_T0);
      for (int a = 0; a < ACC; ++a) block(k + a * LANES, a);
    }
    for (int a = 0; a < ACC; ++a) {     // the blocks left (block k / 8 + a goes to register a), then the tail
      const int64_t kk = k + a * LANES;
      if (kk < K8) {
        block(kk, a);
      } else if (kk == K8 && K8 < K) {
        const __m256 wv = load_tail(wr + K8, K - K8);
        for (int r = 0; r < R; ++r) acc[r][a] = _mm256_fmadd_ps(load_tail(xf + r * K + K8, K - K8), wv, acc[r][a]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 t = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]));
      acc_out[r * (n1 - n0) + (n - n0)] = sum8(t);
    }
  }
#else
  // without AVX-512 or AVX2: eight partial sums per dot product, which the compiler vectorises (-O3 -march=native
  // -ffast-math); their order is fixed, so a row's result does not depend on its batch either
  for (; n < n1; ++n)
    for (int r = 0; r < R; ++r) {
      float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      const w_t* wr = w + n * K;
      const float* xr = xf + r * K;
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int l = 0; l < 8; ++l) part[l] += xr[k + l] * weight_at(wr, k + l);
      for (; k < K; ++k) part[k % 8] += xr[k] * weight_at(wr, k);
      acc_out[r * (n1 - n0) + (n - n0)] = ((part[0] + part[1]) + (part[2] + part[3])) +
                                          ((part[4] + part[5]) + (part[6] + part[7]));
    }
#endif
}

template <typename w_t>
static void run(int64_t R, const float* xf, const w_t* w, int64_t K, int64_t n0, int64_t n1, float* acc) {
  switch (R) {
    case 1: columns<1>(xf, w, K, n0, n1, acc); break;
    case 2: columns<2>(xf, w, K, n0, n1, acc); break;
    case 3: columns<3>(xf, w, K, n0, n1, acc); break;
    case 4: columns<4>(xf, w, K, n0, n1, acc); break;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    // more than RG rows: the first RG, then the rest, each a pass over the block's weight rows (the later ones
    // read them from the cache); every output's sum is the same either way
    case 5: case 6: case 7: case 8:
      columns<RG>(xf, w, K, n0, n1, acc);
      run(R - RG, xf + RG * K, w, K, n0, n1, acc + RG * (n1 - n0));
      break;
#else
    case 5: columns<5>(xf, w, K, n0, n1, acc); break;
    case 6: columns<6>(xf, w, K, n0, n1, acc); break;
    case 7: columns<7>(xf, w, K, n0, n1, acc); break;
    case 8: columns<8>(xf, w, K, n0, n1, acc); break;
#endif
    default: TORCH_CHECK(false, "small_linear: 1 to 8 rows");
  }
}

constexpr int64_t BLOCK = 64;   // output columns per item

// BLAS's single-precision product, as torch's CPU builds export it (MKL's, LP64); weak, so that a build without it
// still loads and takes torch's product instead.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

// fn(i) for every item i in [0, n) over the intra-op threads, each thread taking the next item from a shared
// counter (as cache_attention.cpp's decode kernel takes its items) rather than a fixed share: where another
// process takes one of the cores for a while (the serving processes beside the engine), the thread left running
// does the remaining items instead of waiting at the region's end for its twin's share. An item computes the same
// bits whichever thread takes it.
template <typename F>
static void take_items(int64_t n, F&& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      fn(i);
  });
}

// The product of M rows of fp32 x (M, K) by w (N, K; bf16, fp32 or int8), an item per BLOCK output columns
// (take_items): each output's sum [* sp[n]] [+ bp[n]] goes to store(r, n, value), once, from one thread. Up to
// eight rows the kernel's passes, and a row computes the same bits alone as in any such batch; more rows of an fp32
// weight go to BLAS (MKL: at 16-32 rows of a small model's weights it was faster than the kernel's passes,
// bench/README.md "The stack at many rows"), a single-threaded product per item (torch's whole product where the
// build exports no sgemm_); other weights eight rows a pass.
template <typename Store>
static void product(const float* xp, int64_t M, int64_t K, const torch::Tensor& w, const float* sp, const float* bp,
                    Store&& store) {
  const int64_t N = w.size(0), items = (N + BLOCK - 1) / BLOCK;
  if (M > 8 && w.scalar_type() == at::kFloat) {
    // x is copied into a buffer of torch's allocator first (64-byte aligned): MKL documents that its results may
    // depend on the input's alignment, which a caller's buffer does not fix, and the same rows should give the
    // same bits every step
    auto xa = torch::from_blob(const_cast<float*>(xp), {M, K}, at::kFloat).clone();
    torch::Tensor y;
    if (sgemm_ == nullptr) y = at::mm(xa, w.t());   // torch's product over its threads
    else y = torch::empty({M, N}, at::kFloat);
    const float *xa_p = xa.data_ptr<float>(), *wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    take_items(items, [&](int64_t i) {
      const int64_t n0 = i * BLOCK, n1 = std::min(N, n0 + BLOCK);
      if (sgemm_ != nullptr) {
        // y's columns [n0, n1) = x . (w's rows [n0, n1))^T; in BLAS's column-major terms y^T's rows [n0, n1)
        // are w_rows (K x nb, transposed) . x^T (K x M), leading dimensions K, K and N. Inside the threads'
        // region MKL runs on the calling thread alone (with one worker, on torch's thread count: MKL's is set
        // with it).
        const int m = static_cast<int>(n1 - n0), n = static_cast<int>(M), k = static_cast<int>(K);
        const int ld = static_cast<int>(K), ldc = static_cast<int>(N);
        const float one = 1.f, zero = 0.f;
        sgemm_("T", "N", &m, &n, &k, &one, wp + n0 * K, &ld, xa_p, &ld, &zero, yp + n0, &ldc);
      }
      for (int64_t r = 0; r < M; ++r)
        for (int64_t n = n0; n < n1; ++n) {
          float v = yp[r * N + n];
          if (sp) v *= sp[n];
          if (bp) v += bp[n];
          store(r, n, v);
        }
    });
    return;
  }
  take_items(items, [&](int64_t i) {
    const int64_t n0 = i * BLOCK, n1 = std::min(N, n0 + BLOCK), width = n1 - n0;
    // each thread's sums, kept between items and calls (the kernel writes every one it reads back)
    thread_local std::vector<float> part;
    if (static_cast<int64_t>(part.size()) < M * width) part.resize(M * width);
    // eight rows of x at a time over the block's weight rows (the later passes read them from the cache)
    for (int64_t r0 = 0; r0 < M; r0 += 8) {
      const int64_t R = std::min<int64_t>(8, M - r0);
      const float* xr = xp + r0 * K;
      float* pr = part.data() + r0 * width;
      if (w.scalar_type() == at::kBFloat16)
        run(R, xr, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), K, n0, n1, pr);
      else if (w.scalar_type() == at::kChar)
        run(R, xr, w.data_ptr<int8_t>(), K, n0, n1, pr);
      else
        run(R, xr, w.data_ptr<float>(), K, n0, n1, pr);
    }
    for (int64_t r = 0; r < M; ++r)
      for (int64_t n = n0; n < n1; ++n) {
        float v = part[r * width + (n - n0)];
        if (sp) v *= sp[n];
        if (bp) v += bp[n];
        store(r, n, v);
      }
  });
}

static void check_weight(const torch::Tensor& w, const c10::optional<torch::Tensor>& scale, const char* who) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), who, ": a contiguous (N, K) weight");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kChar || w.scalar_type() == at::kFloat,
              who, ": bf16, fp32 or int8 weights");
  TORCH_CHECK(w.scalar_type() != at::kChar || scale.has_value(), who, ": int8 weights need their scales");
}

torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale,
                           c10::optional<torch::Tensor> bias) {
  check_weight(w, scale, "small_linear");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "small_linear: x (M, K), w (N, K)");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "small_linear: 1 to 8 rows");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "small_linear: bf16 or fp32 x");
  const int64_t M = x.size(0), N = w.size(0);
  auto xf = x.to(at::kFloat).contiguous();
  auto sf = scale.has_value() ? scale->to(at::kFloat).contiguous() : torch::Tensor();
  auto bf = bias.has_value() ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  auto out = torch::empty({M, N}, x.options());
  const float* sp = sf.defined() ? sf.data_ptr<float>() : nullptr;
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) {
    at::BFloat16* o = out.data_ptr<at::BFloat16>();
    product(xf.data_ptr<float>(), M, x.size(1), w, sp, bp, [&](int64_t r, int64_t n, float v) { o[r * N + n] = v; });
  } else {
    float* o = out.data_ptr<float>();
    product(xf.data_ptr<float>(), M, x.size(1), w, sp, bp, [&](int64_t r, int64_t n, float v) { o[r * N + n] = v; });
  }
  return out;
}

#ifndef STARTLUX_NO_MODULE     // decode_stack.cpp includes this file and makes a module of its own
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "x . w^T at 1-8 rows, at the memory's rate (bf16, fp32 or int8 weights)");
}
#endif
