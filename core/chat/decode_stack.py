"""A model's blocks at a decode step of a few rows in one C++ call (csrc/decode_stack.cpp): GPT-2 and every
nanochat version.

A one-stream decode step reads every weight once; what it spends besides is torch's small ops (norms, the
activation, residual adds, the split into heads, rotary, the cache's write, a block at a time) and the Python of
the modules around them: a quarter to a third of a 12 x 768 GPT-2's step on the CPUs measured, most of the demo
model's (bench/README.md, "The blocks in one call"). Here the blocks run as one call on buffers of its own: the
same products (small_linear.cpp), the same cache writes and decode attention (cache_attention.cpp), the rest as
loops over the rows, each value rounded to the model's dtype where torch's ops round it. The embeddings (and
nanochat's smear) before, the final norm and head after stay in the model.

The engine prepares the stack once (`prepare`: the model's parameters as the kernel reads them, the cache's layers)
where EngineConfig.fused_decode allows and the kernel can read every layer, and hands it to each decode pass in its
CacheBatch (`fused`); `GPT2.hidden` and `NanoChatGPT.hidden` call it for a pass of at most its `rows` (ROWS: 2 in
bf16, 4 in fp32 with weights packed for oneDNN, 64 in fp32 with small weights left unpacked, 8 with int8 weights and
fp32 activations). Otherwise, and for prefill, the modules run as they are.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .extensions import extension
from .packed import PackedLinear
from .quantized import Int8Linear

# The most rows a pass runs through the stack, by the model's dtype and its weights' (bench/README.md, "The blocks in
# one call" and "The stack at many rows"). bf16: where its products go to the small-row kernel anyway
# (packed.SMALL_ROWS; from three rows oneDNN's bf16 product is faster on the CPUs with native bf16). fp32 with int8
# weights: the kernel's most (the modules multiply a dequantized fp32 copy from three rows on: the stack was
# 1.6-2.5x faster at 4 and 8 streams on the AVX2 EPYC); fp32 weights that packed.py packs for oneDNN: 4 (1.25-1.6x
# faster there at 4 streams; at 8 oneDNN's packed product made the modules as fast or faster); fp32 weights it
# leaves unpacked (layers under packed.MIN_WEIGHT: a small model, whose modules multiply on MKL through F.linear):
# MAX_ROWS, the stack calling MKL itself beyond the kernel's eight rows.
MAX_ROWS = 64       # csrc/decode_stack.cpp's MAX_STACK_ROWS
ROWS = {(torch.float32, "int8"): 8, (torch.float32, "packed"): 4, (torch.float32, "dtype"): MAX_ROWS,
        (torch.bfloat16, "int8"): 2, (torch.bfloat16, "packed"): 2, (torch.bfloat16, "dtype"): 2}


def weights_kind(model: nn.Module) -> str:
    """How the blocks' linear layers hold their weights, as ROWS reads it: "int8" (any Int8Linear), "packed"
    (any PackedLinear: oneDNN's product from packed.MIN_ROWS rows), else "dtype"."""
    layers = list(model.transformer.h.modules())
    if any(isinstance(m, Int8Linear) for m in layers):
        return "int8"
    return "packed" if any(isinstance(m, PackedLinear) for m in layers) else "dtype"


def kernel():
    """The compiled stack, or None where it cannot be built (then one warning says why)."""
    return extension("startlux_decode_stack", "decode_stack.cpp",
                     "decode steps of a few rows run the model's modules one by one")


def _linear(lin: nn.Module, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """(weight, scale, bias) of a linear layer as the kernel reads them; None for a layer it cannot read."""
    bias = _EMPTY if lin.bias is None else lin.bias.detach().float().contiguous()
    if isinstance(lin, Int8Linear):
        return [lin.qweight, lin.scale, bias]
    # (a subclass of nn.Linear, such as a parametrized one, may compute its weight: only these two are read as stored)
    if type(lin) in (nn.Linear, PackedLinear) and lin.weight.dtype == dtype and lin.weight.is_contiguous():
        return [lin.weight.detach(), _EMPTY, bias]
    return None


def _norm(ln: nn.LayerNorm) -> list[torch.Tensor] | None:
    if ln.weight is None or ln.bias is None:
        return None
    return [ln.weight.detach().float().contiguous(), ln.bias.detach().float().contiguous()]


class GPT2Stack:
    """A GPT-2 model's blocks prepared once for the kernel over one KV cache (`prepare`): called as
    `stack(x, ids, cache_batch)` with x (B, 1, C) after the embeddings and ids (B, 1) the tokens, B at most
    `rows` -> x after the last block."""

    def __init__(self, mod, model: nn.Module, params: list[torch.Tensor], cache, rows: int):
        cfg = model.config
        self.mod, self.params, self.rows = mod, params, rows
        self.keys, self.values = _cache_layers(cache, cfg.n_layer)
        self.n_head, self.eps, self.tanh = cfg.n_head, cfg.layer_norm_eps, cfg.gelu_approximate == "tanh"

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, cache) -> torch.Tensor:
        shared = cache.shared[0] if cache.shared is not None else None
        leaders, lengths = shared if shared is not None else (_NONE, _NONE)
        B, _, C = x.shape
        out = self.mod.gpt2_blocks(x.view(B, C), self.params, self.keys, self.values, cache.slots[0],
                                   cache.tables[0], cache.positions[:, 0], leaders, lengths, self.n_head, self.eps,
                                   self.tanh, cache.threads)
        return out.view(B, 1, C)


class NanoChatStack:
    """nanochat's blocks prepared once for the kernel over one KV cache (`prepare`), called as GPT2Stack is; the
    embeddings, smear before and the final norm and head after stay in the model."""

    def __init__(self, mod, model: nn.Module, params: list[torch.Tensor], cache, rows: int):
        cfg = model.config
        n = cfg.n_layer
        self.mod, self.params, self.rows = mod, params, rows
        self.keys, self.values = _cache_layers(cache, n)
        self.groups = [cache.layer(i)[0] for i in range(n)]
        self.windows = [-1 if w is None else w for w in cfg.layer_windows]
        embeds = getattr(model, "value_embeds", {})
        self.ve = [embeds[str(i)].weight.detach() if str(i) in embeds else _EMPTY for i in range(n)]
        self.cos, self.sin = model.cos, model.sin
        self.resid = model.resid_lambdas.detach().float().contiguous() if cfg.residual_lambdas else _EMPTY
        self.x0 = model.x0_lambdas.detach().float().contiguous() if cfg.residual_lambdas else _EMPTY
        self.backout = (n // 2, float(model.backout_lambda.detach())) if cfg.backout else (-1, 0.0)
        self.scalars = (cfg.n_head, cfg.n_kv_head, cfg.rms_norm_eps, cfg.qk_scale, cfg.ve_gate_range,
                        cfg.ve_gate_channels)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, cache) -> torch.Tensor:
        G = len(cache.slots)
        shared = cache.shared if cache.shared is not None else [None] * G
        leaders = [s[0] if s is not None else _NONE for s in shared]
        lengths = [s[1] if s is not None else _NONE for s in shared]
        B, _, C = x.shape
        out = self.mod.nanochat_blocks(x.view(B, C), self.params, self.ve, ids.view(B), self.cos, self.sin,
                                       self.keys, self.values, self.groups, self.windows, cache.slots, cache.tables,
                                       leaders, lengths, cache.positions[:, 0], *self.scalars, self.resid, self.x0,
                                       *self.backout, cache.threads)
        return out.view(B, 1, C)


def _cache_layers(cache, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's keys and values in `cache`."""
    layers = [cache.layer(i) for i in range(n)]
    return [k for _, k, _ in layers], [v for _, _, v in layers]


def _nanochat_params(model: nn.Module, dtype: torch.dtype) -> list[torch.Tensor] | None:
    params: list[torch.Tensor] = []
    for block in model.transformer.h:
        a, m = block.attn, block.mlp
        per = [_linear(lin, dtype) for lin in (a.c_q, a.c_k, a.c_v, a.c_proj, m.c_fc, m.c_proj)]
        per.append([_EMPTY] * 3 if a.ve_gate is None else _linear(a.ve_gate, dtype))
        if any(p is None for p in per):
            return None
        params.extend(t for p in per for t in p)
    return params


def _gpt2_params(model: nn.Module, dtype: torch.dtype) -> list[torch.Tensor] | None:
    params: list[torch.Tensor] = []
    for block in model.transformer.h:
        per = [_norm(block.ln_1), _linear(block.attn.c_attn, dtype), _linear(block.attn.c_proj, dtype),
               _norm(block.ln_2), _linear(block.mlp["c_fc"], dtype), _linear(block.mlp["c_proj"], dtype)]
        if any(p is None for p in per):
            return None
        params.extend(t for p in per for t in p)
    return params


def prepare(model: nn.Module, cache) -> GPT2Stack | NanoChatStack | None:
    """The stack for a GPT-2 or nanochat `model` (its modules as they are now: quantize or pack them first)
    decoding through `cache` (a KVCache in the model's dtype); None where the kernel does not build or a layer is
    one the kernel cannot read (the caller runs the modules)."""
    from .model import GPT2, NanoChatGPT

    mod = kernel()
    if mod is None or not isinstance(model, (GPT2, NanoChatGPT)):
        return None
    dtype = model.transformer.wte.weight.dtype
    if cache.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or cache.dtype != dtype:
        return None
    rows = ROWS[dtype, weights_kind(model)]
    if isinstance(model, NanoChatGPT):
        params = _nanochat_params(model, dtype)
        return None if params is None else NanoChatStack(mod, model, params, cache, rows)
    params = _gpt2_params(model, dtype)
    if params is None or len(cache.groups) != 1:      # (GPT-2 has no sliding windows: one layer group)
        return None
    return GPT2Stack(mod, model, params, cache, rows)


_NONE = torch.empty(0, dtype=torch.long)
_EMPTY = torch.empty(0)
