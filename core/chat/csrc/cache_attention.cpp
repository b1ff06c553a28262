// Decode attention over the KV cache's rows in place (core/chat/attention.py loads this file).
//
// One query token per batch entry, each at its own position in its own cache row: the query reads that row's
// keys and values where they lie, from the first key its window lets it see to its own position, and no
// further: no gather of rows into a batch, no padding to the longest row, no mask. Entries whose rows begin
// with copies of one row's keys (a shared prefix) form a group that reads those keys once for all of them
// (cascade attention); work is split over (group, head) pairs. A row computes the same bits whatever it is
// batched or grouped with.
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
static inline void prefetch_rows(const scalar_t* p, int64_t n) {
  for (int64_t a = 0; a < n * (int64_t)sizeof(scalar_t); a += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + a, 0, 2);
}

// The scores of four consecutive keys: four independent sums keep several cache lines in flight (one key's dot
// product alone waits on memory). Every score of every path is computed by this function or by score1, in blocks
// of four counted from the row's first key, so a row's scores are the same bits whichever path reads its keys.
template <typename scalar_t>
static inline void score4(const float* qf, const scalar_t* k0, int64_t D, float* out) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float qd = qf[d];
    s0 += qd * as_float(k0[d]);
    s1 += qd * as_float(k0[D + d]);
    s2 += qd * as_float(k0[2 * D + d]);
    s3 += qd * as_float(k0[3 * D + d]);
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

template <typename scalar_t>
static inline float score1(const float* qf, const scalar_t* k, int64_t D) {
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += qf[d] * as_float(k[d]);
  return s;
}

template <typename scalar_t>
static inline void accumulate(float* acc, float p, const scalar_t* v, int64_t D) {
  for (int64_t d = 0; d < D; ++d) acc[d] += p * as_float(v[d]);
}

// One query head of a group of entries. The group's first `shared` keys are read once, from the `leader` row,
// for all its members (rows whose first positions hold copies of the leader's: a prefix-cache hit or n samples
// of one prompt); each member's later keys from its own row. A member's arithmetic is the same, in the same
// order, as when it is alone (a group of one, shared = 0): the same bits. Two passes: the scores (kept in
// per-thread buffers), then the softmax-weighted sum of the values, accumulated in fp32 whatever the cache's dtype.
template <typename scalar_t>
static void attend_group(const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out,
                         const int64_t* rows, const int64_t* positions, const int64_t* members, int64_t G,
                         int64_t leader, int64_t shared, int64_t h, int64_t H, int64_t Hkv, int64_t cap, int64_t D,
                         int64_t window, float scale, std::vector<float>& scores, std::vector<float>& qf,
                         std::vector<float>& acc) {
  const int64_t hk = h / (H / Hkv);
  int64_t most = 0;
  for (int64_t m = 0; m < G; ++m) most = std::max(most, positions[members[m]] + 1);
  scores.resize(G * most);
  qf.resize(G * D);
  acc.assign(G * D, 0.f);
  for (int64_t m = 0; m < G; ++m) {
    const scalar_t* qr = q + (members[m] * H + h) * D;
    for (int64_t d = 0; d < D; ++d) qf[m * D + d] = as_float(qr[d]) * scale;
  }
  const scalar_t* kl = k + (leader * Hkv + hk) * cap * D;
  const scalar_t* vl = v + (leader * Hkv + hk) * cap * D;
  // the shared keys: each block of four read once, scored for every member while it is in L1
  for (int64_t j = 0; j < shared; j += 4) {
    const scalar_t* k0 = kl + j * D;
    prefetch_rows(k0 + PREFETCH_KEYS * D, 4 * D);
    for (int64_t m = 0; m < G; ++m) score4(&qf[m * D], k0, D, &scores[m * most + j]);
  }
  std::vector<float> top(G), total(G);
  for (int64_t m = 0; m < G; ++m) {
    const int64_t b = members[m], pos = positions[b];
    const int64_t lo = window >= 0 ? std::max<int64_t>(0, pos - window) : 0;
    const int64_t n = pos - lo + 1;
    const scalar_t* kr = k + ((rows[b] * Hkv + hk) * cap + lo) * D;
    float* sc = &scores[m * most];
    int64_t j = shared;
    for (; j + 4 <= n; j += 4) {
      prefetch_rows(kr + (j + PREFETCH_KEYS) * D, 4 * D);
      score4(&qf[m * D], kr + j * D, D, sc + j);
    }
    for (; j < n; ++j) sc[j] = score1(&qf[m * D], kr + j * D, D);
    float t = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) t = std::max(t, sc[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      sc[i] = std::exp(sc[i] - t);
      sum += sc[i];
    }
    top[m] = t, total[m] = sum;
  }
  for (int64_t j = 0; j < shared; ++j) {
    const scalar_t* vj = vl + j * D;
    prefetch_rows(vj + PREFETCH_KEYS * D, D);
    for (int64_t m = 0; m < G; ++m) accumulate(&acc[m * D], scores[m * most + j], vj, D);
  }
  for (int64_t m = 0; m < G; ++m) {
    const int64_t b = members[m], pos = positions[b];
    const int64_t lo = window >= 0 ? std::max<int64_t>(0, pos - window) : 0;
    const int64_t n = pos - lo + 1;
    const scalar_t* vr = v + ((rows[b] * Hkv + hk) * cap + lo) * D;
    for (int64_t j = shared; j < n; ++j) {
      prefetch_rows(vr + (j + PREFETCH_KEYS) * D, D);
      accumulate(&acc[m * D], scores[m * most + j], vr + j * D, D);
    }
    scalar_t* o = out + (b * H + h) * D;
    const float inv = 1.f / total[m];
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[m * D + d] * inv);
  }
}

// Entries -> groups: entries with the same leader row and a shared length form one group, which reads the
// leader's first min(shared) keys (rounded down to a block of four) once; every other entry is a group of one.
static void make_groups(const int64_t* leaders, const int64_t* shared, int64_t B, std::vector<int64_t>& members,
                        std::vector<int64_t>& offsets, std::vector<int64_t>& leader_of, std::vector<int64_t>& shared_of) {
  std::vector<int64_t> order(B);
  for (int64_t b = 0; b < B; ++b) order[b] = b;
  if (leaders != nullptr)
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      const int64_t la = shared[a] > 0 ? leaders[a] : -1 - a, lb = shared[b] > 0 ? leaders[b] : -1 - b;
      return la < lb;
    });
  offsets.push_back(0);
  for (int64_t i = 0; i < B;) {
    int64_t e = i + 1;
    if (leaders != nullptr && shared[order[i]] > 0)
      while (e < B && shared[order[e]] > 0 && leaders[order[e]] == leaders[order[i]]) ++e;
    int64_t common = 0;
    if (e - i > 1) {
      common = std::numeric_limits<int64_t>::max();
      for (int64_t j = i; j < e; ++j) common = std::min(common, shared[order[j]]);
      common -= common % 4;
    }
    for (int64_t j = i; j < e; ++j) members.push_back(order[j]);
    offsets.push_back(members.size());
    leader_of.push_back(e - i > 1 ? leaders[order[i]] : -1);
    shared_of.push_back(common);
    i = e;
  }
}

template <typename scalar_t>
static void decode_kernel(const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out,
                          const int64_t* rows, const int64_t* positions, const int64_t* leaders,
                          const int64_t* shared, int64_t B, int64_t H, int64_t Hkv, int64_t cap, int64_t D,
                          int64_t window, float scale) {
  std::vector<int64_t> members, offsets, leader_of, shared_of;
  make_groups(window >= 0 ? nullptr : leaders, shared, B, members, offsets, leader_of, shared_of);
  const int64_t groups = leader_of.size();
  at::parallel_for(0, groups * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf, acc;
    for (int64_t gh = begin; gh < end; ++gh) {
      const int64_t g = gh / H, h = gh % H;
      attend_group(q, k, v, out, rows, positions, &members[offsets[g]], offsets[g + 1] - offsets[g],
                   leader_of[g], shared_of[g], h, H, Hkv, cap, D, window, scale, scores, qf, acc);
    }
  });
}

// q (B, H, D); k, v one layer of the cache (rows, Hkv, capacity, D), contiguous; rows, positions (B,) int64;
// window: keys a query sees before its own position (-1: all); leaders, shared (B,) int64 or empty: the row
// whose first shared[b] keys entry b's row holds copies of (shared 0: none; ignored for a windowed layer)
// -> (B, H, D)
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                               torch::Tensor positions, int64_t window, double scale, torch::Tensor leaders,
                               torch::Tensor shared) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), "decode_attention: q (B, H, D), k/v (R, Hkv, C, D)");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "decode_attention: contiguous tensors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "decode_attention: one dtype");
  TORCH_CHECK(q.size(2) == k.size(3) && q.size(1) % k.size(1) == 0, "decode_attention: head sizes");
  auto rows_c = rows.to(torch::kLong).contiguous();
  auto pos_c = positions.to(torch::kLong).contiguous();
  const int64_t B = q.size(0);
  TORCH_CHECK(rows_c.numel() == B && pos_c.numel() == B, "decode_attention: one row and position per entry");
  auto lead_c = leaders.to(torch::kLong).contiguous();
  auto shared_c = shared.to(torch::kLong).contiguous();
  const bool grouped = lead_c.numel() > 0;
  TORCH_CHECK(!grouped || (lead_c.numel() == B && shared_c.numel() == B), "decode_attention: one leader per entry");
  if (grouped) {
    const int64_t* p = pos_c.data_ptr<int64_t>();
    const int64_t* l = lead_c.data_ptr<int64_t>();
    const int64_t* n = shared_c.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(n[b] <= 0 || (n[b] <= p[b] && l[b] >= 0 && l[b] < k.size(0)), "decode_attention: a shared prefix ",
                  "lies within its entry's keys and a leader is a row");
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), rows_c.data_ptr<int64_t>(), pos_c.data_ptr<int64_t>(),
                            grouped ? lead_c.data_ptr<int64_t>() : nullptr,
                            grouped ? shared_c.data_ptr<int64_t>() : nullptr, B, q.size(1), k.size(1), k.size(2),
                            q.size(2), window, static_cast<float>(scale));
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
