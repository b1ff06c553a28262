"""Linear layers' products at a decode step's few rows, at the memory's rate (csrc/small_linear.cpp).

With one to a few sequences running, a decode step multiplies a handful of rows by every weight of the model:
the step is the time to read the weights, and a product is as fast as it reads them. oneDNN's and MKL's
products are built for many rows; at one row they read bf16 weights well below the memory's rate on the CPUs
measured (bench/README.md, "One stream at the memory floor"). The kernel here reads each weight row once for
all the step's rows (up to MAX_ROWS), converts it in registers (bf16: a shift; int8: a widening, with the
output channel's scale applied to the sum) and keeps fp32 sums; a row computes the same bits alone as in a
batch. `packed.PackedLinear` and `quantized.Int8Linear` call it at the row counts where it was measured faster.
"""
from __future__ import annotations

import torch

from .extensions import extension

MAX_ROWS = 8


def kernel():
    """The compiled kernel, or None where it cannot be built (then one warning says why)."""
    return extension("startlux_small_linear", "small_linear.cpp",
                     "linear layers at a decode step's few rows stay on oneDNN's and MKL's products")


def small_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) . weight (N, K)^T [* scale (N)] [+ bias (N)] -> (..., N) in x's dtype, for at most MAX_ROWS
    rows of x (bf16 or fp32) and a bf16, fp32 or int8 weight (int8 with its scales) on the CPU."""
    rows = x.reshape(-1, x.size(-1))
    return kernel().small_linear(rows, weight, scale, bias).view(*x.shape[:-1], weight.size(0))
