// A model's blocks (GPT-2's, nanochat's) at a decode step of a few rows (a small model's up to 64), in one call
// (core/chat/decode_stack.py loads this file).
//
// At a few rows a decode step is the time to read the weights, plus everything between the reads: per block
// two LayerNorms, a split into heads, two residual adds, GELU, the cache's write and its attention, each a torch
// op with its dispatch and allocation, and the Python of the modules around them. Here a block is the same
// arithmetic on buffers this call owns: LayerNorm, GELU and the adds are loops over the rows, the products are
// small_linear.cpp's (the bias and the residual add applied as each output is stored), the keys and values
// go into the cache and attention reads it as cache_attention.cpp does. Each value is rounded to the model's dtype
// where torch's ops round it (after each op), so a bf16 model computes what its modules do up to the order of a
// sum; a row computes the same bits alone as in a batch.
#define STARTLUX_NO_MODULE
#include "small_linear.cpp"
#include "cache_attention.cpp"

#include <cmath>

namespace {

// v as the model's dtype would hold it (bf16: rounded to nearest even), kept as fp32
inline float held(float v, bool bf16) { return bf16 ? static_cast<float>(c10::BFloat16(v)) : v; }

// out (M, C) = LayerNorm of x (M, C) with weight g and bias b (fp32), in fp32, rounded as the model's dtype holds it
void layer_norm(const float* x, int64_t M, int64_t C, const float* g, const float* b, float eps, bool bf16,
                float* out) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * C;
    float mean = 0.f;
    for (int64_t c = 0; c < C; ++c) mean += xr[c];
    mean /= C;
    float var = 0.f;
    for (int64_t c = 0; c < C; ++c) var += (xr[c] - mean) * (xr[c] - mean);
    const float rstd = 1.f / std::sqrt(var / C + eps);
    for (int64_t c = 0; c < C; ++c) out[r * C + c] = held((xr[c] - mean) * rstd * g[c] + b[c], bf16);
  }
}

// GELU of each of n values in place (tanh: GPT-2's approximation; else the exact one with erf)
void gelu(float* x, int64_t n, bool tanh_form, bool bf16) {
  if (tanh_form) {
    const float k = std::sqrt(2.f / static_cast<float>(M_PI));
    for (int64_t i = 0; i < n; ++i)
      x[i] = 0.5f * x[i] * (1.f + std::tanh(k * (x[i] + 0.044715f * x[i] * x[i] * x[i])));
  } else {
    const float k = static_cast<float>(M_SQRT1_2);
    for (int64_t i = 0; i < n; ++i) x[i] = 0.5f * x[i] * (1.f + std::erf(x[i] * k));
  }
  if (bf16)
    for (int64_t i = 0; i < n; ++i) x[i] = held(x[i], true);
}

// fp32 pointer of an optional fp32 tensor (nullptr when undefined or empty)
const float* maybe(const torch::Tensor& t) { return t.defined() && t.numel() ? t.data_ptr<float>() : nullptr; }

// torch's intra-op threads set to n for a scope (0: as they are)
struct Threads {
  int before;
  explicit Threads(int64_t n) : before(at::get_num_threads()) {
    if (n > 0 && n != before) at::set_num_threads(static_cast<int>(n));
  }
  ~Threads() {
    if (at::get_num_threads() != before) at::set_num_threads(before);
  }
};

// The pass's new keys and values into one layer's cache (K, V), then its queries' decode attention over it on
// `threads` torch threads (0: as they are) -> (B, H, D) as fp32
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& K,
                     const torch::Tensor& V, const torch::Tensor& slots, const torch::Tensor& tables,
                     const torch::Tensor& positions, int64_t window, double scale, const torch::Tensor& leaders,
                     const torch::Tensor& shared, int64_t threads) {
  write_kv(K, V, k, v, slots);
  torch::Tensor y;
  {
    Threads t(threads);
    y = decode_attention(q, K, V, tables, positions, window, scale, leaders, shared);
  }
  return y.to(at::kFloat).contiguous();
}

// x (B, C) as fp32 values, the residual stream the blocks update
std::vector<float> stream_of(const torch::Tensor& x) {
  auto xf = x.to(at::kFloat).contiguous();
  return std::vector<float>(xf.data_ptr<float>(), xf.data_ptr<float>() + xf.numel());
}

constexpr int64_t MAX_STACK_ROWS = 64;
constexpr int PER_LAYER = 16;
constexpr int GPT2_WEIGHTS[4] = {2, 5, 10, 13};   // c_attn, attn c_proj, c_fc, mlp c_proj: weight, scale, bias

}  // namespace

// x (B, C): the hidden state after the embeddings, fp32 or bf16; params: per layer, in order, ln_1's weight and
// bias, attn.c_attn's weight, scale and bias, attn.c_proj's, ln_2's weight and bias, mlp.c_fc's and mlp.c_proj's
// (weights bf16, fp32 or int8 with its fp32 scales, else an empty tensor; LayerNorm parameters, biases fp32 or
// empty); keys, values: each layer's cache (N, H, bs, D) in x's dtype; slots (B, 1); tables (B, width); positions
// (B,); leaders, shared as decode_attention takes them; attention_threads: torch's threads while attention runs
// (0: as they are) -> x after the last block, (B, C) in x's dtype.
torch::Tensor gpt2_blocks(torch::Tensor x, std::vector<torch::Tensor> params, std::vector<torch::Tensor> keys,
                          std::vector<torch::Tensor> values, torch::Tensor slots, torch::Tensor tables,
                          torch::Tensor positions, torch::Tensor leaders, torch::Tensor shared, int64_t n_head,
                          double eps, bool tanh_gelu, int64_t attention_threads) {
  const int64_t L = static_cast<int64_t>(keys.size());
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= MAX_STACK_ROWS, "gpt2_blocks: x (B, C), 1 to 64 rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gpt2_blocks: fp32 or bf16 x");
  TORCH_CHECK(static_cast<int64_t>(params.size()) == PER_LAYER * L && values.size() == keys.size(),
              "gpt2_blocks: 16 parameters and a cache layer per block");
  const int64_t B = x.size(0), C = x.size(1), H = n_head, D = C / H;
  TORCH_CHECK(H > 0 && C % H == 0, "gpt2_blocks: the width splits into heads");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = params.data() + l * PER_LAYER;
    const int64_t ins[4] = {C, C, C, 4 * C}, outs[4] = {3 * C, C, 4 * C, C};
    for (int j = 0; j < 4; ++j) {
      const torch::Tensor& w = p[GPT2_WEIGHTS[j]];
      const torch::Tensor& s = p[GPT2_WEIGHTS[j] + 1];
      check_weight(w, s.numel() ? c10::optional<torch::Tensor>(s) : c10::nullopt, "gpt2_blocks");
      TORCH_CHECK(w.size(0) == outs[j] && w.size(1) == ins[j], "gpt2_blocks: layer ", l, "'s weight shapes");
      TORCH_CHECK(w.scalar_type() == at::kChar || w.scalar_type() == x.scalar_type(),
                  "gpt2_blocks: weights in x's dtype or int8");
    }
    for (int j : {0, 1, 3, 4, 6, 7, 8, 9, 11, 12, 14, 15})
      TORCH_CHECK(!p[j].numel() || (p[j].scalar_type() == at::kFloat && p[j].is_contiguous()),
                  "gpt2_blocks: LayerNorm parameters, biases and scales as contiguous fp32");
    TORCH_CHECK(keys[l].scalar_type() == x.scalar_type(), "gpt2_blocks: the cache in x's dtype");
  }
  auto opts = x.options();
  auto q = torch::empty({B, H, D}, opts), k = torch::empty({B, H, 1, D}, opts), v = torch::empty({B, H, 1, D}, opts);
  std::vector<float> xs = stream_of(x), h(B * C), wide(B * 4 * C);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // a product's output stored as the model's dtype holds it, into q, k and v
  auto store_qkv = [&](auto* qp, auto* kp, auto* vp) {
    return [=](int64_t r, int64_t n, float val) {
      const int64_t part = n / C, c = n % C;
      auto* dst = part == 0 ? qp : (part == 1 ? kp : vp);
      dst[r * C + c] = val;
    };
  };
  // ... added to the residual stream (each term rounded first, as torch adds two tensors of the dtype)
  auto add_to_stream = [&](int64_t r, int64_t n, float val) {
    xs[r * C + n] = held(xs[r * C + n] + held(val, bf16), bf16);
  };
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = params.data() + l * PER_LAYER;
    layer_norm(xs.data(), B, C, maybe(p[0]), maybe(p[1]), static_cast<float>(eps), bf16, h.data());
    if (bf16)
      product(h.data(), B, C, p[2], maybe(p[3]), maybe(p[4]),
              store_qkv(q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>()));
    else
      product(h.data(), B, C, p[2], maybe(p[3]), maybe(p[4]),
              store_qkv(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>()));
    auto y = attend(q, k, v, keys[l], values[l], slots, tables, positions, -1, scale, leaders, shared,
                    attention_threads);
    product(y.data_ptr<float>(), B, C, p[5], maybe(p[6]), maybe(p[7]), add_to_stream);
    layer_norm(xs.data(), B, C, maybe(p[8]), maybe(p[9]), static_cast<float>(eps), bf16, h.data());
    const int64_t F = 4 * C;
    product(h.data(), B, C, p[10], maybe(p[11]), maybe(p[12]),
            [&](int64_t r, int64_t n, float val) { wide[r * F + n] = held(val, bf16); });
    gelu(wide.data(), B * F, tanh_gelu, bf16);
    product(wide.data(), B, F, p[13], maybe(p[14]), maybe(p[15]), add_to_stream);
  }
  return torch::from_blob(xs.data(), {B, C}, at::kFloat).to(x.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

namespace {

// out (M, C) = x / sqrt(mean(x^2) + eps) per row of n values (nanochat's parameter-free RMSNorm), in fp32, rounded
// as the model's dtype holds it; x and out may be the same buffer
void rms_norm(const float* x, int64_t M, int64_t n, float eps, bool bf16, float* out) {
  for (int64_t r = 0; r < M; ++r) {
    float ss = 0.f;
    for (int64_t c = 0; c < n; ++c) ss += x[r * n + c] * x[r * n + c];
    const float inv = 1.f / std::sqrt(ss / n + eps);
    for (int64_t c = 0; c < n; ++c) out[r * n + c] = held(x[r * n + c] * inv, bf16);
  }
}

// The rotary embedding of one head vector of D values in place (nanochat's half split), with cos/sin (D/2) at its
// position; `each`: round every product and sum as the model's dtype holds it (cos/sin tables in bf16, as torch
// computes bf16 * bf16), else only the result (fp32 tables)
void rotate(float* h, int64_t D, const float* cs, const float* sn, bool each, bool bf16) {
  const int64_t d = D / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float a = h[i], b = h[d + i];
    float y1, y2;
    if (each) {
      y1 = held(held(a * cs[i], true) + held(b * sn[i], true), true);
      y2 = held(held(b * cs[i], true) - held(a * sn[i], true), true);
    } else {
      y1 = held(a * cs[i] + b * sn[i], bf16);
      y2 = held(b * cs[i] - a * sn[i], bf16);
    }
    h[i] = y1, h[d + i] = y2;
  }
}

template <typename scalar_t>
void to_tensor(const float* src, scalar_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
}

constexpr int NANO_PER_LAYER = 21;   // (weight, scale, bias) of c_q, c_k, c_v, attn c_proj, c_fc, mlp c_proj, ve_gate

}  // namespace

// nanochat's blocks (model.py's NanoChatBlock, with the residual and x0 scalars, value embeddings and backout).
// x (B, C) after the embeddings (and smear: x0), fp32 or bf16; params: per layer NANO_PER_LAYER tensors (weight,
// scale or empty, bias or empty; ve_gate's weight empty where the layer has no value embedding); ve: per layer its
// value-embedding table (vocab, Hkv * D) in x's dtype or empty; ids (B,) the tokens; cos, sin (positions, D / 2)
// with their dtype; keys, values per layer, `group` and `window` (-1: full) per layer; slots, tables, leaders,
// shared per layer group; lambdas: resid and x0 (fp32, one per layer) or empty; backout_layer (-1: none) and its
// lambda -> x after the last block and backout, (B, C) in x's dtype.
torch::Tensor nanochat_blocks(torch::Tensor x, std::vector<torch::Tensor> params, std::vector<torch::Tensor> ve,
                              torch::Tensor ids, torch::Tensor cos, torch::Tensor sin,
                              std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                              std::vector<int64_t> group, std::vector<int64_t> window,
                              std::vector<torch::Tensor> slots, std::vector<torch::Tensor> tables,
                              std::vector<torch::Tensor> leaders, std::vector<torch::Tensor> shared,
                              torch::Tensor positions, int64_t n_head, int64_t n_kv_head, double eps,
                              double qk_scale, double ve_range, int64_t ve_channels, torch::Tensor resid,
                              torch::Tensor x0_lambdas, int64_t backout_layer, double backout_lambda,
                              int64_t attention_threads) {
  const int64_t L = static_cast<int64_t>(keys.size());
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= MAX_STACK_ROWS, "nanochat_blocks: x (B, C), 1 to 64 rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "nanochat_blocks: fp32 or bf16 x");
  TORCH_CHECK(static_cast<int64_t>(params.size()) == NANO_PER_LAYER * L && values.size() == keys.size() &&
                  ve.size() == keys.size() && group.size() == keys.size() && window.size() == keys.size(),
              "nanochat_blocks: parameters, a value embedding, a cache layer, group and window per block");
  const int64_t B = x.size(0), C = x.size(1), H = n_head, Hkv = n_kv_head, D = C / H, KV = Hkv * D, F = 4 * C;
  TORCH_CHECK(H > 0 && Hkv > 0 && C % H == 0 && H % Hkv == 0 && D % 2 == 0, "nanochat_blocks: head shapes");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto ids_c = ids.to(torch::kLong).contiguous();
  auto pos_c = positions.to(torch::kLong).contiguous();
  TORCH_CHECK(ids_c.numel() == B && pos_c.numel() == B, "nanochat_blocks: a token and a position per row");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == D / 2 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == sin.scalar_type(),
              "nanochat_blocks: cos and sin (positions, D / 2)");
  const int64_t* tok = ids_c.data_ptr<int64_t>();
  const int64_t* pos = pos_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(pos[b] >= 0 && pos[b] < cos.size(0), "nanochat_blocks: a position");
  const bool rope_each = cos.scalar_type() == at::kBFloat16;
  auto cosf = cos.to(at::kFloat).contiguous(), sinf = sin.to(at::kFloat).contiguous();
  const bool lambdas = resid.numel() > 0;
  TORCH_CHECK(!lambdas || (resid.numel() == L && x0_lambdas.numel() == L && resid.scalar_type() == at::kFloat &&
                           x0_lambdas.scalar_type() == at::kFloat),
              "nanochat_blocks: fp32 resid and x0 lambdas, one per layer");
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = params.data() + l * NANO_PER_LAYER;
    const int64_t ins[7] = {C, C, C, C, C, F, ve_channels}, outs[7] = {C, KV, KV, C, F, C, Hkv};
    for (int j = 0; j < 7; ++j) {
      const torch::Tensor& w = p[3 * j];
      if (j == 6 && !w.numel()) {
        TORCH_CHECK(!ve[l].numel(), "nanochat_blocks: a value embedding without its gate");
        continue;
      }
      check_weight(w, p[3 * j + 1].numel() ? c10::optional<torch::Tensor>(p[3 * j + 1]) : c10::nullopt,
                   "nanochat_blocks");
      TORCH_CHECK(w.size(0) == outs[j] && w.size(1) == ins[j], "nanochat_blocks: layer ", l, "'s weight shapes");
      TORCH_CHECK(w.scalar_type() == at::kChar || w.scalar_type() == x.scalar_type(),
                  "nanochat_blocks: weights in x's dtype or int8");
      for (int e : {1, 2})
        TORCH_CHECK(!p[3 * j + e].numel() || (p[3 * j + e].scalar_type() == at::kFloat && p[3 * j + e].is_contiguous()),
                    "nanochat_blocks: scales and biases as contiguous fp32");
    }
    if (ve[l].numel()) {
      TORCH_CHECK(ve[l].dim() == 2 && ve[l].size(1) == KV && ve[l].is_contiguous() &&
                      ve[l].scalar_type() == x.scalar_type(), "nanochat_blocks: value embeddings (vocab, Hkv * D)");
      for (int64_t b = 0; b < B; ++b) TORCH_CHECK(tok[b] >= 0 && tok[b] < ve[l].size(0), "nanochat_blocks: a token");
    }
    TORCH_CHECK(keys[l].scalar_type() == x.scalar_type(), "nanochat_blocks: the cache in x's dtype");
    TORCH_CHECK(group[l] >= 0 && group[l] < static_cast<int64_t>(slots.size()) && slots.size() == tables.size() &&
                    slots.size() == leaders.size() && slots.size() == shared.size(), "nanochat_blocks: layer groups");
  }
  auto opts = x.options();
  auto q = torch::empty({B, H, D}, opts), k = torch::empty({B, Hkv, 1, D}, opts), v = torch::empty({B, Hkv, 1, D}, opts);
  std::vector<float> xs = stream_of(x), x0 = xs, mid, h(B * C), qf(B * C), kf(B * KV), vf(B * KV), wide(B * F),
      gate_in(B * std::max<int64_t>(ve_channels, 1)), gate(B * Hkv);
  const auto none = torch::empty({0}, torch::kLong);   // a windowed layer reads no shared prefix
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const float feps = static_cast<float>(eps);
  auto add_to_stream = [&](int64_t r, int64_t n, float val) {
    xs[r * C + n] = held(xs[r * C + n] + held(val, bf16), bf16);
  };
  auto into = [&](std::vector<float>& dst, int64_t width) {
    return [&dst, width, bf16](int64_t r, int64_t n, float val) { dst[r * width + n] = held(val, bf16); };
  };
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = params.data() + l * NANO_PER_LAYER;
    if (lambdas) {
      const float a = resid.data_ptr<float>()[l], c = x0_lambdas.data_ptr<float>()[l];
      for (int64_t i = 0; i < B * C; ++i) xs[i] = held(held(a * xs[i], bf16) + held(c * x0[i], bf16), bf16);
    }
    // attention
    rms_norm(xs.data(), B, C, feps, bf16, h.data());
    product(h.data(), B, C, p[0], maybe(p[1]), maybe(p[2]), into(qf, C));
    product(h.data(), B, C, p[3], maybe(p[4]), maybe(p[5]), into(kf, KV));
    product(h.data(), B, C, p[6], maybe(p[7]), maybe(p[8]), into(vf, KV));
    if (ve[l].numel()) {   // v += range * sigmoid(ve_gate(h[:, :channels])) per kv head * the token's value embedding
      for (int64_t b = 0; b < B; ++b)
        std::memcpy(gate_in.data() + b * ve_channels, h.data() + b * C, ve_channels * sizeof(float));
      product(gate_in.data(), B, ve_channels, p[18], maybe(p[19]), maybe(p[20]), into(gate, Hkv));
      const float range = static_cast<float>(ve_range);
      for (int64_t b = 0; b < B; ++b) {
        const int64_t row = tok[b] * KV;
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          const float g = held(range * held(1.f / (1.f + std::exp(-gate[b * Hkv + hk])), bf16), bf16);
          for (int64_t d = 0; d < D; ++d) {
            float e = bf16 ? static_cast<float>(ve[l].data_ptr<at::BFloat16>()[row + hk * D + d])
                           : ve[l].data_ptr<float>()[row + hk * D + d];
            float& t = vf[b * KV + hk * D + d];
            t = held(t + held(g * e, bf16), bf16);
          }
        }
      }
    }
    const float qs = static_cast<float>(qk_scale);
    for (int64_t b = 0; b < B; ++b) {
      const float* cs = cosf.data_ptr<float>() + pos[b] * (D / 2);
      const float* sn = sinf.data_ptr<float>() + pos[b] * (D / 2);
      // each query head, then each key head: rotated, normed, scaled
      for (int64_t i = 0; i < H + Hkv; ++i) {
        float* hv = i < H ? qf.data() + b * C + i * D : kf.data() + b * KV + (i - H) * D;
        rotate(hv, D, cs, sn, rope_each, bf16);
        rms_norm(hv, 1, D, feps, bf16, hv);
        if (qs != 1.f)
          for (int64_t d = 0; d < D; ++d) hv[d] = held(hv[d] * qs, bf16);
      }
    }
    if (bf16) {
      to_tensor(qf.data(), q.data_ptr<at::BFloat16>(), B * C);
      to_tensor(kf.data(), k.data_ptr<at::BFloat16>(), B * KV);
      to_tensor(vf.data(), v.data_ptr<at::BFloat16>(), B * KV);
    } else {
      to_tensor(qf.data(), q.data_ptr<float>(), B * C);
      to_tensor(kf.data(), k.data_ptr<float>(), B * KV);
      to_tensor(vf.data(), v.data_ptr<float>(), B * KV);
    }
    const int64_t g = group[l];
    const bool full = window[l] < 0;
    auto y = attend(q, k, v, keys[l], values[l], slots[g], tables[g], positions, window[l], scale,
                    full ? leaders[g] : none, full ? shared[g] : none, attention_threads);
    product(y.data_ptr<float>(), B, C, p[9], maybe(p[10]), maybe(p[11]), add_to_stream);
    // MLP: relu(c_fc(norm(x)))^2 through c_proj
    rms_norm(xs.data(), B, C, feps, bf16, h.data());
    product(h.data(), B, C, p[12], maybe(p[13]), maybe(p[14]), [&](int64_t r, int64_t n, float val) {
      const float a = std::max(held(val, bf16), 0.f);
      wide[r * F + n] = held(a * a, bf16);
    });
    product(wide.data(), B, F, p[15], maybe(p[16]), maybe(p[17]), add_to_stream);
    if (l == backout_layer) mid = xs;
  }
  if (!mid.empty()) {
    const float lam = static_cast<float>(backout_lambda);
    for (int64_t i = 0; i < B * C; ++i) xs[i] = held(xs[i] - held(lam * mid[i], bf16), bf16);
  }
  return torch::from_blob(xs.data(), {B, C}, at::kFloat).to(x.scalar_type(), false, true);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gpt2_blocks", &gpt2_blocks, "a GPT-2 model's blocks at a decode step of 1-8 rows, in one call");
  m.def("nanochat_blocks", &nanochat_blocks, "nanochat's blocks at a decode step of 1-8 rows, in one call");
}
