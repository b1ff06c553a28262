// A GPT-2 model's blocks at a decode step of a few rows, in one call (core/chat/decode_stack.py loads this file).
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

constexpr int PER_LAYER = 16;

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
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 8, "gpt2_blocks: x (B, C), 1 to 8 rows");
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
      const torch::Tensor& w = p[2 + 3 * j + (j >= 2 ? 2 : 0)];
      const torch::Tensor& s = p[3 + 3 * j + (j >= 2 ? 2 : 0)];
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
  std::vector<float> xs(B * C), h(B * C), wide(B * 4 * C);
  {
    auto xf = x.to(at::kFloat).contiguous();
    std::memcpy(xs.data(), xf.data_ptr<float>(), B * C * sizeof(float));
  }
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
    write_kv(keys[l], values[l], k, v, slots);
    torch::Tensor y;
    {
      Threads t(attention_threads);
      y = decode_attention(q, keys[l], values[l], tables, positions, -1, scale, leaders, shared);
    }
    auto yf = y.to(at::kFloat).contiguous();
    product(yf.data_ptr<float>(), B, C, p[5], maybe(p[6]), maybe(p[7]), add_to_stream);
    layer_norm(xs.data(), B, C, maybe(p[8]), maybe(p[9]), static_cast<float>(eps), bf16, h.data());
    const int64_t F = 4 * C;
    product(h.data(), B, C, p[10], maybe(p[11]), maybe(p[12]),
            [&](int64_t r, int64_t n, float val) { wide[r * F + n] = held(val, bf16); });
    gelu(wide.data(), B * F, tanh_gelu, bf16);
    product(wide.data(), B, F, p[13], maybe(p[14]), maybe(p[15]), add_to_stream);
  }
  auto out = torch::from_blob(xs.data(), {B, C}, at::kFloat).to(x.scalar_type(), /*non_blocking=*/false,
                                                                /*copy=*/true);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gpt2_blocks", &gpt2_blocks, "a GPT-2 model's blocks at a decode step of 1-8 rows, in one call");
  m.def("small_linear", &small_linear, "x . w^T at 1-8 rows (as startlux_small_linear's)");
}
