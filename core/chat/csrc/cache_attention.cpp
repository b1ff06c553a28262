// Decode attention over the KV cache's blocks in place (core/chat/attention.py loads this file).
//
// One query token per batch entry, each at its own position of its own sequence: the query reads the keys and
// values where they lie, block by block through the entry's block table, from the first key its window lets it
// see to its own position, and no further: no gather into a batch, no padding to the longest entry, no mask.
// Entries whose tables begin with the same blocks (a prefix-cache hit, n samples of a prompt) form a group that
// reads those keys once for all of them (cascade attention); work is split over (group, head) pairs. An entry
// computes the same bits whatever it is batched or grouped with.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
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

template <typename scalar_t>
static inline void prefetch_rows(const scalar_t* p, int64_t n) {
  for (int64_t a = 0; a < n * (int64_t)sizeof(scalar_t); a += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + a, 0, 2);
}

// Where entry b's keys (or values) of head hk lie: its block table, the blocks' layout (blocks, Hkv, bs, D).
template <typename scalar_t>
struct Paged {
  const scalar_t* base;
  const int64_t* tables;
  int64_t width, Hkv, bs, D;
  // the key at position j of the entry whose table row is t, head hk
  inline const scalar_t* at(const int64_t* t, int64_t hk, int64_t j) const {
    return base + ((t[j / bs] * Hkv + hk) * bs + j % bs) * D;
  }
};

// The scores of four consecutive keys: four independent sums keep several cache lines in flight (one key's dot
// product alone waits on memory). Every score of every path is computed by this function or by score1, as
// score_range splits a key range.
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

// How far ahead of the key being read its successors are fetched towards the core (into L2), in keys. A block of
// one head is a short contiguous run (block_size x D elements) and the next one lies elsewhere, so the hardware's
// stream prefetcher does not run ahead across blocks: the kernel fetches the key this many positions ahead, found
// through the block table, as it reads each group of keys.
constexpr int64_t PREFETCH_KEYS = 32;

// Where entry t's key `j` of head hk lies, or null past `n`.
template <typename scalar_t>
static inline const scalar_t* ahead(const Paged<scalar_t>& K, const int64_t* t, int64_t hk, int64_t j, int64_t n) {
  return j < n ? K.at(t, hk, j) : nullptr;
}

// The scores of keys lo..n-1 of one entry (sc[j - lo]), read run by run: each run is the part of one block that
// lies in the range, scored in fours from the run's start, then one by one. Every path reads a key range this
// way, so an entry's scores are the same bits whichever path reads them (alone, or its shared blocks in a group,
// which start at block boundaries as every run of a window-free entry does).
template <typename scalar_t>
static inline void score_range(const float* qf, const Paged<scalar_t>& K, const int64_t* t, int64_t hk, int64_t lo,
                               int64_t n, float* sc, int64_t G = 1, int64_t stride = 0) {
  const int64_t D = K.D, bs = K.bs;
  for (int64_t a = lo; a < n;) {
    const int64_t e = std::min(n, (a / bs + 1) * bs);
    const scalar_t* k0 = K.at(t, hk, a);
    int64_t j = a;
    for (; j + 4 <= e; j += 4) {
      if (const scalar_t* p = ahead(K, t, hk, j + PREFETCH_KEYS, n)) prefetch_rows(p, 4 * D);
      for (int64_t m = 0; m < G; ++m) score4(qf + m * D, k0 + (j - a) * D, D, sc + m * stride + j - lo);
    }
    for (; j < e; ++j)
      for (int64_t m = 0; m < G; ++m) sc[m * stride + j - lo] = score1(qf + m * D, k0 + (j - a) * D, D);
    a = e;
  }
}

// acc (per member, D) += the members' weights p[j - lo] times values lo..n-1, run by run.
template <typename scalar_t>
static inline void weigh_range(float* acc, const Paged<scalar_t>& V, const int64_t* t, int64_t hk, int64_t lo,
                               int64_t n, const float* p, int64_t G = 1, int64_t stride = 0) {
  const int64_t D = V.D, bs = V.bs;
  for (int64_t a = lo; a < n;) {
    const int64_t e = std::min(n, (a / bs + 1) * bs);
    const scalar_t* v0 = V.at(t, hk, a);
    for (int64_t j = a; j < e; ++j) {
      if (const scalar_t* q = ahead(V, t, hk, j + PREFETCH_KEYS, n)) prefetch_rows(q, D);
      for (int64_t m = 0; m < G; ++m) accumulate(acc + m * D, p[m * stride + j - lo], v0 + (j - a) * D, D);
    }
    a = e;
  }
}

// One query head of a group of entries. The group's first `shared` keys (whole blocks its members' tables
// list alike: a prefix-cache hit, n samples of one prompt) are read once, from the `leader` entry's table, for
// all members; each member's later keys from its own blocks. A member's arithmetic is the same, in the same order,
// as when it is alone (a group of one, shared = 0): the same bits. Two passes: the scores (kept in per-thread
// buffers), then the softmax-weighted sum of the values, accumulated in fp32 whatever the cache's dtype.
template <typename scalar_t>
static void attend_group(const scalar_t* q, const Paged<scalar_t>& K, const Paged<scalar_t>& V, scalar_t* out,
                         const int64_t* positions, const int64_t* members, int64_t G, int64_t leader, int64_t shared,
                         int64_t h, int64_t H, int64_t window, float scale, std::vector<float>& scores,
                         std::vector<float>& qf, std::vector<float>& acc) {
  const int64_t D = K.D, hk = h / (H / K.Hkv);
  int64_t most = 0;
  for (int64_t m = 0; m < G; ++m) most = std::max(most, positions[members[m]] + 1);
  scores.resize(G * most);
  qf.resize(G * D);
  acc.assign(G * D, 0.f);
  for (int64_t m = 0; m < G; ++m) {
    const scalar_t* qr = q + (members[m] * H + h) * D;
    for (int64_t d = 0; d < D; ++d) qf[m * D + d] = as_float(qr[d]) * scale;
  }
  const int64_t* tl = shared > 0 ? K.tables + leader * K.width : nullptr;
  // the shared keys: each block read once, scored for every member while it is in L1
  if (shared > 0) score_range(qf.data(), K, tl, hk, 0, shared, scores.data(), G, most);
  std::vector<float> top(G), total(G);
  for (int64_t m = 0; m < G; ++m) {
    const int64_t b = members[m], pos = positions[b];
    const int64_t lo = window >= 0 ? std::max<int64_t>(0, pos - window) : 0;
    const int64_t n = pos - lo + 1;
    float* sc = &scores[m * most];
    score_range(&qf[m * D], K, K.tables + b * K.width, hk, lo + shared, pos + 1, sc + shared, 1, 0);
    float t = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) t = std::max(t, sc[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      sc[i] = std::exp(sc[i] - t);
      sum += sc[i];
    }
    top[m] = t, total[m] = sum;
  }
  if (shared > 0) weigh_range(acc.data(), V, tl, hk, 0, shared, scores.data(), G, most);
  for (int64_t m = 0; m < G; ++m) {
    const int64_t b = members[m], pos = positions[b];
    const int64_t lo = window >= 0 ? std::max<int64_t>(0, pos - window) : 0;
    weigh_range(&acc[m * D], V, V.tables + b * V.width, hk, lo + shared, pos + 1, &scores[m * most] + shared, 1, 0);
    scalar_t* o = out + (b * H + h) * D;
    const float inv = 1.f / total[m];
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[m * D + d] * inv);
  }
}

// Entries -> groups: entries with the same leader and a shared length form one group, which reads the leader's
// first min(shared) keys (whole blocks) once; every other entry is a group of one.
static void make_groups(const int64_t* leaders, const int64_t* shared, int64_t B, int64_t bs,
                        std::vector<int64_t>& members, std::vector<int64_t>& offsets, std::vector<int64_t>& leader_of,
                        std::vector<int64_t>& shared_of) {
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
      common -= common % bs;
    }
    for (int64_t j = i; j < e; ++j) members.push_back(order[j]);
    offsets.push_back(members.size());
    leader_of.push_back(e - i > 1 ? leaders[order[i]] : -1);
    shared_of.push_back(common);
    i = e;
  }
}

template <typename scalar_t>
static void decode_kernel(const scalar_t* q, const Paged<scalar_t>& K, const Paged<scalar_t>& V, scalar_t* out,
                          const int64_t* positions, const int64_t* leaders, const int64_t* shared, int64_t B,
                          int64_t H, int64_t window, float scale) {
  std::vector<int64_t> members, offsets, leader_of, shared_of;
  make_groups(window >= 0 ? nullptr : leaders, shared, B, K.bs, members, offsets, leader_of, shared_of);
  const int64_t groups = leader_of.size(), items = groups * H;
  // The threads take (group, head) items one at a time from a shared counter instead of a fixed share each:
  // where other processes take a core for a while (the serving processes beside the engine), the thread left
  // running does the rest of the items instead of waiting at the region's end for its preempted twin's share.
  // An item computes the same bits whichever thread takes it.
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scores, qf, acc;
    for (int64_t gh = next.fetch_add(1, std::memory_order_relaxed); gh < items;
         gh = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t g = gh / H, h = gh % H;
      attend_group(q, K, V, out, positions, &members[offsets[g]], offsets[g + 1] - offsets[g], leader_of[g],
                   shared_of[g], h, H, window, scale, scores, qf, acc);
    }
  });
}

// q (B, H, D); k, v one layer of the cache (blocks, Hkv, block_size, D), contiguous; tables (B, width) int64:
// each entry's block table; positions (B,) int64; window: keys a query sees before its own position (-1: all);
// leaders, shared (B,) int64 or empty: the entry whose table lists the first shared[b] keys of entry b's too
// (shared 0: none; ignored for a windowed layer) -> (B, H, D)
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                               torch::Tensor positions, int64_t window, double scale, torch::Tensor leaders,
                               torch::Tensor shared) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), "decode_attention: q (B, H, D), k/v (N, Hkv, bs, D)");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "decode_attention: contiguous tensors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "decode_attention: one dtype");
  TORCH_CHECK(q.size(2) == k.size(3) && q.size(1) % k.size(1) == 0, "decode_attention: head sizes");
  auto tables_c = tables.to(torch::kLong).contiguous();
  auto pos_c = positions.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), bs = k.size(2), width = tables_c.size(1), N = k.size(0);
  TORCH_CHECK(tables_c.dim() == 2 && tables_c.size(0) == B && pos_c.numel() == B,
              "decode_attention: one table and position per entry");
  const int64_t* p = pos_c.data_ptr<int64_t>();
  const int64_t* t = tables_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(p[b] >= 0 && p[b] < width * bs, "decode_attention: a position beyond its block table");
    for (int64_t i = 0; i <= p[b] / bs; ++i)
      TORCH_CHECK(t[b * width + i] >= 0 && t[b * width + i] < N, "decode_attention: a block id out of range");
  }
  auto lead_c = leaders.to(torch::kLong).contiguous();
  auto shared_c = shared.to(torch::kLong).contiguous();
  const bool grouped = lead_c.numel() > 0;
  TORCH_CHECK(!grouped || (lead_c.numel() == B && shared_c.numel() == B), "decode_attention: one leader per entry");
  if (grouped) {
    const int64_t* l = lead_c.data_ptr<int64_t>();
    const int64_t* n = shared_c.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(n[b] <= 0 || (n[b] <= p[b] && l[b] >= 0 && l[b] < B), "decode_attention: a shared prefix ",
                  "lies within its entry's keys and a leader is an entry");
      for (int64_t i = 0; n[b] > 0 && i < n[b] / bs; ++i)
        TORCH_CHECK(t[b * width + i] == t[l[b] * width + i], "decode_attention: a shared prefix lies in the same ",
                    "blocks as its leader's");
    }
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "decode_attention", [&] {
    const Paged<scalar_t> K{k.data_ptr<scalar_t>(), t, width, k.size(1), bs, k.size(3)};
    const Paged<scalar_t> V{v.data_ptr<scalar_t>(), t, width, k.size(1), bs, k.size(3)};
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), K, V, out.data_ptr<scalar_t>(), p,
                            grouped ? lead_c.data_ptr<int64_t>() : nullptr,
                            grouped ? shared_c.data_ptr<int64_t>() : nullptr, B, q.size(1), window,
                            static_cast<float>(scale));
  });
  return out;
}

// The pass's new keys and values into the cache: k, v (B, Hkv, T, D) contiguous -> K, V one layer (N, Hkv, bs, D)
// at the slot each token has (slots (B, T): block * bs + offset). A copy of each head vector; torch's indexed
// copies cost ~100 us a call here.
void write_kv(torch::Tensor K, torch::Tensor V, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(K.is_contiguous() && V.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "write_kv: contiguous");
  TORCH_CHECK(K.scalar_type() == k.scalar_type() && V.scalar_type() == v.scalar_type(), "write_kv: one dtype");
  const int64_t B = k.size(0), H = k.size(1), T = k.size(2), D = k.size(3), bs = K.size(2), N = K.size(0);
  TORCH_CHECK(K.size(1) == H && K.size(3) == D && slots.size(0) == B && slots.size(1) == T, "write_kv: shapes");
  auto slots_c = slots.to(torch::kLong).contiguous();
  const int64_t* sl = slots_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(sl[i] >= 0 && sl[i] < N * bs, "write_kv: a slot out of range");
  const size_t bytes = D * k.element_size();
  char* Kd = static_cast<char*>(K.data_ptr());
  char* Vd = static_cast<char*>(V.data_ptr());
  const char* kd = static_cast<const char*>(k.data_ptr());
  const char* vd = static_cast<const char*>(v.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t blk = sl[b * T + t] / bs, off = sl[b * T + t] % bs;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t dst = ((blk * H + h) * bs + off) * bytes;
        const int64_t src = ((b * H + h) * T + t) * bytes;
        std::memcpy(Kd + dst, kd + src, bytes);
        std::memcpy(Vd + dst, vd + src, bytes);
      }
    }
}

#ifndef STARTLUX_NO_MODULE     // decode_stack.cpp includes this file and makes a module of its own
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over KV-cache blocks in place");
  m.def("write_kv", &write_kv, "new keys and values into KV-cache blocks");
}
#endif
