"""A GPT-2 model's blocks at a decode step of one or two rows in one C++ call (csrc/decode_stack.cpp).

A one-stream decode step reads every weight once; what it spends besides is torch's small ops (two LayerNorms,
GELU, two adds, the split into heads, the cache's write a block) and the Python of the modules around them: a
quarter to a third of the step on the CPUs measured (bench/README.md, "One stream at the memory floor"). Here
the blocks run as one call on buffers of its own: the same products (small_linear.cpp), the same cache writes and
decode attention (cache_attention.cpp), LayerNorm, GELU and the residual adds as loops, each value rounded to
the model's dtype where torch's ops round it. The embeddings before and the final LayerNorm and head after stay in
the model.

`GPT2.hidden` takes this path for a decode pass of at most ROWS rows whose CacheBatch says so (`fused`: the
engine's EngineConfig.fused_decode, on the CPU, with the kernels built) when every linear layer of the blocks is
one it can read (`blocks`); otherwise, and for prefill, the modules run as they are.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .extensions import extension
from .packed import PackedLinear
from .quantized import Int8Linear

ROWS = 2        # the rows at which the products go to the small-row kernel (packed.SMALL_ROWS) anyway


def kernel():
    """The compiled stack, or None where it cannot be built (then one warning says why)."""
    return extension("startlux_decode_stack", "decode_stack.cpp",
                     "decode steps of one or two rows run the model's modules one by one")


def _linear(lin: nn.Module, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """(weight, scale, bias) of a linear layer as the kernel reads them; None for a layer it cannot read."""
    empty = torch.empty(0)
    bias = empty if lin.bias is None else lin.bias.detach().float().contiguous()
    if isinstance(lin, Int8Linear):
        return [lin.qweight, lin.scale, bias]
    # (a subclass of nn.Linear, such as a parametrized one, may compute its weight: only these two are read as stored)
    if type(lin) in (nn.Linear, PackedLinear) and lin.weight.dtype == dtype and lin.weight.is_contiguous():
        return [lin.weight.detach(), empty, bias]
    return None


def _norm(ln: nn.LayerNorm) -> list[torch.Tensor] | None:
    if ln.weight is None or ln.bias is None:
        return None
    return [ln.weight.detach().float().contiguous(), ln.bias.detach().float().contiguous()]


class Blocks:
    """A GPT-2 model's blocks as the kernel takes them, for one dtype; rebuilt when a module of theirs is replaced
    (int8 quantization, packing) or the dtype changes."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype, self.modules = dtype, self.parts(model)
        self.params: list[torch.Tensor] | None = []
        for block in model.transformer.h:
            per = [_norm(block.ln_1), _linear(block.attn.c_attn, dtype), _linear(block.attn.c_proj, dtype),
                   _norm(block.ln_2), _linear(block.mlp["c_fc"], dtype), _linear(block.mlp["c_proj"], dtype)]
            if any(p is None for p in per):
                self.params = None
                return
            self.params.extend(t for p in per for t in p)

    @staticmethod
    def parts(model: nn.Module) -> tuple:
        return tuple(m for b in model.transformer.h
                     for m in (b.ln_1, b.attn.c_attn, b.attn.c_proj, b.ln_2, b.mlp["c_fc"], b.mlp["c_proj"]))

    def current(self, model: nn.Module, dtype: torch.dtype) -> bool:
        return dtype == self.dtype and all(a is b for a, b in zip(self.parts(model), self.modules))


def gpt2_blocks(model: nn.Module, x: torch.Tensor, cache) -> torch.Tensor | None:
    """x (B, 1, C) after the embeddings -> after the last block, through the kernel; None where it does not apply
    (the caller runs the modules)."""
    mod = kernel()
    if mod is None:
        return None
    stack = model.__dict__.get("_decode_blocks")
    if stack is None or not stack.current(model, x.dtype):
        stack = model.__dict__["_decode_blocks"] = Blocks(model, x.dtype)
    if stack.params is None:
        return None
    layers = [cache.cache.layer(i) for i in range(len(model.transformer.h))]
    if layers[0][1].dtype != x.dtype or any(g != 0 for g, _, _ in layers):
        return None
    leaders, shared = cache.shared[0] if cache.shared is not None and cache.shared[0] is not None else (_NONE, _NONE)
    B, _, C = x.shape
    out = mod.gpt2_blocks(x.view(B, C), stack.params, [k for _, k, _ in layers], [v for _, _, v in layers],
                          cache.slots[0], cache.tables[0], cache.positions[:, 0], leaders, shared,
                          model.config.n_head, model.config.layer_norm_eps, model.config.gelu_approximate == "tanh",
                          cache.threads)
    return out.view(B, 1, C)


_NONE = torch.empty(0, dtype=torch.long)
