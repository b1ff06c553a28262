// Decode attention over the KV cache's rows in place (core/chat/attention.py loads this file).
//
// One query token per batch entry, each at its own position in its own cache row: the query reads that row's
// keys and values where they lie, from the first key its window lets it see to its own position, and no
// further: no gather of rows into a batch, no padding to the longest row, no mask. Work is split over
// (entry, head) pairs; each pair's result depends on nothing else in the batch, so a row computes the same
// whatever it is batched with. Two passes per pair: the scores (kept in a per-thread buffer), then the
// softmax-weighted sum of the values, accumulated in fp32 whatever the cache's dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// An element as fp32: bf16 is the top half of an fp32, so a shift the compiler vectorises converts it.
static inline float as_float(float x) { return x; }
static inline float as_float(double x) { return static_cast<float>(x); }
static inline float as_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// how far ahead of the key being read its successors are fetched towards the core (into L2)
constexpr int64_t PREFETCH_KEYS = 32;

template <typename scalar_t>
static void decode_kernel(const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out,
                          const int64_t* rows, const int64_t* positions, int64_t B, int64_t H, int64_t Hkv,
                          int64_t cap, int64_t D, int64_t window, float scale) {
  const int64_t group = H / Hkv;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> qf(D), acc(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const int64_t pos = positions[b];
      const int64_t lo = window >= 0 ? std::max<int64_t>(0, pos - window) : 0;
      const int64_t n = pos - lo + 1;
      const scalar_t* kr = k + ((rows[b] * Hkv + h / group) * cap + lo) * D;
      const scalar_t* vr = v + ((rows[b] * Hkv + h / group) * cap + lo) * D;
      const scalar_t* qr = q + bh * D;
      for (int64_t d = 0; d < D; ++d) qf[d] = as_float(qr[d]) * scale;
      scores.resize(n);
      float top = -std::numeric_limits<float>::infinity();
      // four keys at a time: four independent sums keep several cache lines in flight (one key's dot product
      // alone waits on memory), and the keys a few blocks ahead are prefetched
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        const scalar_t* k0 = kr + j * D;
        for (int64_t a = 0; a < 4 * D * (int64_t)sizeof(scalar_t); a += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(k0 + PREFETCH_KEYS * D) + a, 0, 2);
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qf[d];
          s0 += qd * as_float(k0[d]);
          s1 += qd * as_float(k0[D + d]);
          s2 += qd * as_float(k0[2 * D + d]);
          s3 += qd * as_float(k0[3 * D + d]);
        }
        scores[j] = s0, scores[j + 1] = s1, scores[j + 2] = s2, scores[j + 3] = s3;
        top = std::max(top, std::max(std::max(s0, s1), std::max(s2, s3)));
      }
      for (; j < n; ++j) {
        const scalar_t* kj = kr + j * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qf[d] * as_float(kj[d]);
        scores[j] = s;
        top = std::max(top, s);
      }
      float total = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        scores[j] = std::exp(scores[j] - top);
        total += scores[j];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const scalar_t* vj = vr + j * D;
        for (int64_t a = 0; a < D * (int64_t)sizeof(scalar_t); a += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(vj + PREFETCH_KEYS * D) + a, 0, 2);
        const float p = scores[j];
        for (int64_t d = 0; d < D; ++d) acc[d] += p * as_float(vj[d]);
      }
      scalar_t* o = out + bh * D;
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[d] * inv);
    }
  });
}

// q (B, H, D); k, v one layer of the cache (rows, Hkv, capacity, D), contiguous; rows, positions (B,) int64;
// window: keys a query sees before its own position (-1: all) -> (B, H, D)
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                               torch::Tensor positions, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), "decode_attention: q (B, H, D), k/v (R, Hkv, C, D)");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "decode_attention: contiguous tensors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "decode_attention: one dtype");
  TORCH_CHECK(q.size(2) == k.size(3) && q.size(1) % k.size(1) == 0, "decode_attention: head sizes");
  auto rows_c = rows.to(torch::kLong).contiguous();
  auto pos_c = positions.to(torch::kLong).contiguous();
  TORCH_CHECK(rows_c.numel() == q.size(0) && pos_c.numel() == q.size(0), "decode_attention: one row and position per entry");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), rows_c.data_ptr<int64_t>(), pos_c.data_ptr<int64_t>(),
                            q.size(0), q.size(1), k.size(1), k.size(2), q.size(2), window,
                            static_cast<float>(scale));
  });
  return out;
}

// The pass's new keys and values into the cache: k, v (B, Hkv, T, D) contiguous -> K, V one layer (R, Hkv, C, D)
// at K[rows[b], h, positions[b, t]]. A copy of each head vector; torch's indexed copies cost ~100 us a call here.
void write_kv(torch::Tensor K, torch::Tensor V, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
              torch::Tensor positions) {
  TORCH_CHECK(K.is_contiguous() && V.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "write_kv: contiguous");
  TORCH_CHECK(K.scalar_type() == k.scalar_type() && V.scalar_type() == v.scalar_type(), "write_kv: one dtype");
  const int64_t B = k.size(0), H = k.size(1), T = k.size(2), D = k.size(3), C = K.size(2);
  TORCH_CHECK(K.size(1) == H && K.size(3) == D && positions.size(0) == B && positions.size(1) == T, "write_kv: shapes");
  auto rows_c = rows.to(torch::kLong).contiguous();
  auto pos_c = positions.to(torch::kLong).contiguous();
  const int64_t* r = rows_c.data_ptr<int64_t>();
  const int64_t* p = pos_c.data_ptr<int64_t>();
  const size_t bytes = D * k.element_size();
  char* Kd = static_cast<char*>(K.data_ptr());
  char* Vd = static_cast<char*>(V.data_ptr());
  const char* kd = static_cast<const char*>(k.data_ptr());
  const char* vd = static_cast<const char*>(v.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t dst = ((r[b] * H + h) * C + p[b * T + t]) * bytes;
        const int64_t src = ((b * H + h) * T + t) * bytes;
        std::memcpy(Kd + dst, kd + src, bytes);
        std::memcpy(Vd + dst, vd + src, bytes);
      }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over KV-cache rows in place");
  m.def("write_kv", &write_kv, "new keys and values into KV-cache rows");
}
