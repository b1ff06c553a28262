"""Weight-only int8 linear layers (`chat_weights: int8`): the weights of the model's linear layers stored as int8,
one scale per output channel, the activations and everything else in the model's dtype.

`quantize_linears` replaces each nn.Linear of a loaded model by an `Int8Linear` (symmetric, round to nearest:
w ~ q * scale with q in [-127, 127] and scale = max |w| of the channel / 127). A product then reads a byte a
weight instead of two (bf16) or four (fp32):

- on the CPU, up to SMALL_ROWS rows (a decode step of a few streams) go through small_linear.py's kernel,
  which widens the int8 weights in registers and applies the scale to each sum; larger products (prefill, many
  streams) through oneDNN on a packed copy of the dequantized weight in the model's dtype (q * scale, rounded
  once), kept beside the int8 one, where oneDNN's many-row product is faster than reading bytes;
- elsewhere (CUDA) the weight is dequantized into the model's dtype for each product (memory saved, no speed
  gained; CUDA graphs record it as any other op).

What it costs in fidelity and what it gains is measured in docs/configuration.md ("One stream and int8 weights").
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import packed as packed_module
from .small_linear import kernel as small_kernel
from .small_linear import small_linear

SMALL_ROWS = 2      # at 3 rows and more oneDNN's product on the dequantized copy was faster (bench.small_linear)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weight -> (q int8 (N, K), scale fp32 (N,)): per output channel, symmetric, round to nearest."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8 with a scale per output channel (inference only)."""

    def __init__(self, lin: nn.Linear, small_rows: bool = True):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        q, scale = quantize(lin.weight)
        dtype, device = lin.weight.dtype, lin.weight.device
        self.register_buffer("qweight", q.to(device))
        self.register_buffer("scale", scale.to(device))
        self.bias = None if lin.bias is None else nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        self.dtype = dtype
        self.packed = None          # oneDNN's packed copy of q * scale, for products of many rows on the CPU
        self.small_rows = 0
        if device.type == "cpu":
            if dtype in packed_module.ROWS and packed_module.packs(dtype):   # else F.linear at 3 rows and more
                dequantized = (q.float() * scale[:, None]).to(dtype)
                self.packed = torch.ops.mkldnn._reorder_linear_weight(dequantized, packed_module.BATCH_HINT)
            if small_rows and small_kernel() is not None:
                self.small_rows = SMALL_ROWS

    def dequantized(self) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.size(-1)
        if x.device.type == "cpu":
            if rows <= self.small_rows:
                return small_linear(x, self.qweight, self.scale, self.bias)
            if self.packed is not None and x.dtype == self.dtype:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per output channel"


def quantize_linears(model: nn.Module, small_rows: bool = True) -> int:
    """Replace every nn.Linear (or packed one) of `model` by an Int8Linear, in place -> how many. A layer listed
    under two parents is quantized once; a head tied to the embedding gets an int8 copy of its own (the
    embedding stays in the model's dtype: a lookup reads one row)."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    done: dict[int, Int8Linear] = {}
    for parent, name, child in targets:
        if id(child) not in done:
            done[id(child)] = Int8Linear(child, small_rows)
        setattr(parent, name, done[id(child)])
    return len(done)
