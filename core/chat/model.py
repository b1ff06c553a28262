"""The two chat architectures, written for serving: every forward can read and write a shared KV cache.

- `NanoChatGPT`: nanochat's GPT (rotary embeddings, QK-norm, parameter-free RMSNorm also right after
  the embedding, relu^2 MLP, no biases, grouped-query attention, untied head, logit softcap), with the
  features its later versions added, each switched on by its config.json key: per-layer residual and
  embedding scalars, sliding-window layers, value embeddings, the q/k scale, smear and backout
  (docs/checkpoints.md has the versions).
- `GPT2`: the GPT-2 / nanoGPT architecture (learned positions, LayerNorm with bias, GELU, tied head),
  for checkpoints like seed 001's.

Both are called as `model(ids)` -> logits (B, T, vocab) for a plain causal pass, or with
`cache=CacheBatch` to run a batch whose rows sit at different positions of a KV cache.
Parameter names follow nanochat / nanoGPT so their checkpoints load after stripping `_orig_mod.`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention import cache_attention
from .config import ChatModelConfig
from .kv_cache import CacheBatch


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.size(-1),), eps=eps).type_as(x)


# On CUDA, attention never goes to cuDNN's kernel: cuDNN builds an execution plan for every new shape, and
# decoding grows the key length by one every step, so every step would build new plans (bench/README.md
# has the profile).
CUDA_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: CacheBatch | None,
           window: int | None = None) -> torch.Tensor:
    """q (B, H, T, D), k/v (B, Hkv, T, D) -> (B, H, T, D); causal, through the cache when given; a query at
    position i sees keys i - window .. i when `window` is set. (On CUDA, `ChatNetwork.forward` has chosen the
    attention backends for the whole pass.)"""
    gqa = q.size(1) != k.size(1)
    if cache is None:
        T = q.size(2)
        if window is None or window >= T - 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        i = torch.arange(T, device=q.device)
        back = i[:, None] - i[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(back >= 0) & (back <= window), enable_gqa=gqa)
    return cache_attention(q, k, v, layer, cache, window)


class ChatNetwork(nn.Module):
    """Shared calling convention of both architectures."""

    config: ChatModelConfig

    def get_device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def needs_previous(self) -> bool:
        """Whether a pass that starts past position 0 needs the token before it (CacheBatch.previous)."""
        return False

    def positions(self, ids: torch.Tensor, cache: CacheBatch | None) -> torch.Tensor:
        if cache is None:
            return torch.arange(ids.size(1), device=ids.device)[None, :].expand(ids.size(0), -1)
        return cache.positions

    def forward(self, ids: torch.Tensor, cache: CacheBatch | None = None,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, V) in fp32; with `last` (B,) index per row, only those positions: (B, V)."""
        if ids.is_cuda:                     # once per pass, not per layer: entering the context costs ~12 us
            with sdpa_kernel(CUDA_ATTENTION_BACKENDS):
                return self._forward(ids, cache, last)
        return self._forward(ids, cache, last)

    def _forward(self, ids: torch.Tensor, cache: CacheBatch | None, last: torch.Tensor | None) -> torch.Tensor:
        x = self.hidden(ids, cache)
        if last is not None:
            x = x[torch.arange(x.size(0), device=x.device), last]
        return self.logits(x)


class NanoChatAttention(nn.Module):
    def __init__(self, cfg: ChatModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.window = cfg.layer_windows[layer]
        D = cfg.head_dim
        self.c_q = nn.Linear(cfg.n_embd, cfg.n_head * D, bias=False)
        self.c_k = nn.Linear(cfg.n_embd, cfg.n_kv_head * D, bias=False)
        self.c_v = nn.Linear(cfg.n_embd, cfg.n_kv_head * D, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.ve_gate = (nn.Linear(cfg.ve_gate_channels, cfg.n_kv_head, bias=False)
                        if layer in cfg.value_embed_layers else None)

    def forward(self, x, ve, cos, sin, cache):
        B, T, _ = x.shape
        cfg = self.cfg
        D, eps = cfg.head_dim, cfg.rms_norm_eps
        q = self.c_q(x).view(B, T, cfg.n_head, D)
        k = self.c_k(x).view(B, T, cfg.n_kv_head, D)
        v = self.c_v(x).view(B, T, cfg.n_kv_head, D)
        if ve is not None:      # the value embedding, through a per-head gate read from the input's first channels
            gate = cfg.ve_gate_range * torch.sigmoid(self.ve_gate(x[..., :cfg.ve_gate_channels]))
            v = v + gate.unsqueeze(-1) * ve.view(B, T, cfg.n_kv_head, D)
        q, k = rms_norm(rotate(q, cos, sin), eps), rms_norm(rotate(k, cos, sin), eps)
        if cfg.qk_scale != 1.0:
            q, k = q * cfg.qk_scale, k * cfg.qk_scale
        y = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.layer, cache, self.window)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on (B, T, H, D) with cos/sin (B, T, 1, D/2), nanochat's half-split convention."""
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)


class NanoChatMLP(nn.Module):
    def __init__(self, cfg: ChatModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class NanoChatBlock(nn.Module):
    def __init__(self, cfg: ChatModelConfig, layer: int):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.attn = NanoChatAttention(cfg, layer)
        self.mlp = NanoChatMLP(cfg)

    def forward(self, x, ve, cos, sin, cache):
        x = x + self.attn(rms_norm(x, self.eps), ve, cos, sin, cache)
        return x + self.mlp(rms_norm(x, self.eps))


SMEAR_CHANNELS = 24     # smear_gate reads this many leading channels of the token's normed embedding


class NanoChatGPT(ChatNetwork):
    def __init__(self, config: ChatModelConfig):
        super().__init__()
        self.config = config
        c = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(c.vocab_size, c.n_embd),
            "h": nn.ModuleList(NanoChatBlock(c, i) for i in range(c.n_layer)),
        })
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        if c.residual_lambdas:
            self.resid_lambdas = nn.Parameter(torch.ones(c.n_layer))
            self.x0_lambdas = nn.Parameter(torch.zeros(c.n_layer))
        if c.value_embeds:
            self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(c.vocab_size, c.n_kv_head * c.head_dim)
                                               for i in c.value_embed_layers})
        if c.smear:
            self.smear_gate = nn.Linear(SMEAR_CHANNELS, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if c.backout:
            self.backout_lambda = nn.Parameter(torch.zeros(1))
        D = c.head_dim
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        freqs = torch.outer(torch.arange(c.sequence_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    @property
    def needs_previous(self) -> bool:
        return self.config.smear

    def hidden(self, ids, cache=None):
        c = self.config
        eps = c.rms_norm_eps
        x = rms_norm(self.transformer.wte(ids), eps)
        if c.smear:
            x = self._smear(x, ids, cache)
        stack = cache.fused if cache is not None else None
        if stack is not None and x.size(0) <= stack.rows:      # decode_stack.py: the blocks (and backout) in one call
            return rms_norm(stack(x, ids, cache), eps)
        pos = self.positions(ids, cache)
        cos, sin = self.cos[pos][:, :, None, :], self.sin[pos][:, :, None, :]
        x0, mid = x, None
        for i, block in enumerate(self.transformer.h):
            if c.residual_lambdas:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](ids) if str(i) in getattr(self, "value_embeds", ()) else None
            x = block(x, ve, cos, sin, cache)
            if c.backout and i == c.n_layer // 2:
                mid = x
        if mid is not None:
            x = x - self.backout_lambda * mid
        return rms_norm(x, eps)

    def _smear(self, x: torch.Tensor, ids: torch.Tensor, cache: CacheBatch | None) -> torch.Tensor:
        """x[t] + smear_lambda * sigmoid(smear_gate(x[t])) * x[t-1], x the normed embeddings; position 0 has no
        previous token. A pass that starts later reads the token before its first input from the cache batch, so
        a chunked prefill, a prefix-cache hit and a decode step compute what one full pass does."""
        if cache is not None and cache.previous is not None:
            prev = cache.previous
            first = rms_norm(self.transformer.wte(prev.clamp(min=0)), self.config.rms_norm_eps)
            first = first * (prev >= 0)[:, None].to(first.dtype)
        elif cache is None or cache.starts_at_zero:
            first = torch.zeros_like(x[:, 0])
        else:
            raise ValueError("this model mixes in each token's predecessor (smear): a pass that does not start at "
                             "position 0 needs CacheBatch.previous")
        before = torch.cat((first[:, None], x[:, :-1]), dim=1)
        gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS]))
        return x + gate * before

    def logits(self, x):
        logits = self.lm_head(x).float()
        cap = self.config.logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ChatModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x, cache):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.cfg.n_head, self.cfg.head_dim).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = attend(q, k, v, self.layer, cache)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ChatModelConfig, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.attn = GPT2Attention(cfg, layer)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
                                  "c_proj": nn.Linear(4 * cfg.n_embd, cfg.n_embd)})
        self.approximate = cfg.gelu_approximate

    def forward(self, x, cache):
        x = x + self.attn(self.ln_1(x), cache)
        h = F.gelu(self.mlp["c_fc"](self.ln_2(x)), approximate=self.approximate)
        return x + self.mlp["c_proj"](h)


class GPT2(ChatNetwork):
    def __init__(self, config: ChatModelConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "wpe": nn.Embedding(config.sequence_len, config.n_embd),
            "h": nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer)),
            "ln_f": nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps),
        })
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight   # tied

    def hidden(self, ids, cache=None):
        x = self.transformer.wte(ids) + self.transformer.wpe(self.positions(ids, cache))
        stack = cache.fused if cache is not None else None
        if stack is not None and x.size(0) <= stack.rows:      # decode_stack.py: the blocks in one call
            x = stack(x, ids, cache)
        else:
            for block in self.transformer.h:
                x = block(x, cache)
        return self.transformer.ln_f(x)

    def logits(self, x):
        return self.lm_head(x).float()


def build_model(config: ChatModelConfig) -> ChatNetwork:
    return NanoChatGPT(config) if config.arch == "nanochat" else GPT2(config)


# Random values of nanochat's scalars for tests and fresh training runs: (mean, spread) of a uniform draw, near
# what nanochat's own init and training give them, varied so that a test notices one applied wrongly.
_SCALARS = {"resid_lambdas": (1.0, 0.2), "x0_lambdas": (0.15, 0.2), "smear_lambda": (0.5, 0.4),
            "backout_lambda": (0.2, 0.2)}


def init_weights(model: ChatNetwork, seed: int = 0, std: float = 0.02) -> ChatNetwork:
    """Random weights for tests and fresh training runs (deterministic for a seed)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in _SCALARS:
                mean, spread = _SCALARS[name]
                p.copy_(mean + spread * (torch.rand(p.shape, generator=g) - 0.5))
            elif name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model
