"""Linear layers on the CPU through oneDNN with their weights packed once (inference only).

torch's `F.linear` on the CPU calls MKL's matrix product on the weight as it is stored, which at the batch
sizes of a decode step (a row per running sequence) runs slower than the same product with the weight
reordered ahead of time into oneDNN's blocked layout (bench/README.md, "Where the chat engine's step goes",
has the figures). torch ships that path: `mkldnn._reorder_linear_weight` packs a weight once (for a
batch-size hint; any batch size may then use it) and `mkldnn._linear_pointwise` multiplies by the packed
copy. It is what inductor's freezing pass emits for a CPU linear layer with a dynamic batch, and what
vLLM's CPU backend does through its own oneDNN handles. Here it is applied without compiling: a large
`nn.Linear` of a model in eval mode becomes a `PackedLinear` that shares the original's parameters (so
checkpoints, tied weights and `state_dict` are unchanged) and keeps the packed copy beside them (that
layer's weight memory twice).

fp32 and bf16 weights are packed (bf16 runs on AMX or AVX-512 BF16 where the CPU has them). A product that needs
gradients, another dtype or another device goes through `F.linear` as before, and so do the two cases where
the packed product is slower: a layer whose weight has fewer than MIN_WEIGHT elements is not packed (oneDNN's
cost per call outweighs the gain), and an fp32 product of fewer than MIN_ROWS or more than MAX_ROWS rows uses
the original weight (at 1-2 rows MKL reads the weight at the memory's full rate; a
prefill's hundreds of rows gain nothing). `python -m bench.engine_profile --compare-linear` measures both.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from .small_linear import kernel as small_kernel
from .small_linear import small_linear

BATCH_HINT = 32          # the rows oneDNN tunes the packed layout for; every batch size can use it
MIN_WEIGHT = 1 << 19     # elements (2 MiB of fp32): smaller fp32 layers stay as they are; bf16 layers of any
                         # size are packed (256 x 256 was 1.4x faster packed at 1-512 rows)
MIN_ROWS = 4             # fp32 products of fewer rows use the original weight,
MAX_ROWS = 64            # and so do products of more (prefill): there MKL's product is as fast or faster
# bf16 products have no such range: oneDNN computes the original weight's too, and the packed one was faster at
# 1-256 rows (bench/README.md, "The engine in the hardware's precision")
ROWS = {torch.float32: (MIN_ROWS, MAX_ROWS), torch.bfloat16: (1, 1 << 62)}
# bf16 and fp32 products of at most this many rows (a decode step of one or two streams) by a weight of at least
# SMALL_MIN_WEIGHT elements go to small_linear.py's kernel instead, which reads such a weight near the memory's
# rate where oneDNN's product does not; at 3 rows and more, or a weight that stays in the core's cache
# (768 x 768 bf16), oneDNN's is faster (bench.small_linear; EngineConfig.small_row_kernel off: never). fp32's
# one- and two-row products otherwise go to MKL, which on the AVX2 EPYC used one core of two (bench/README.md,
# "The small-row kernel on AVX2")
SMALL_ROWS = {torch.bfloat16: 2, torch.float32: 2}
SMALL_MIN_WEIGHT = 1 << 20


def available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU: bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, so
    an AVX2 EPYC packs fp32 only (asked once, with a tiny weight)."""
    if not available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), BATCH_HINT)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Linear):
    """An nn.Linear whose inference products use a oneDNN-packed copy of its weight."""

    packed: torch.Tensor
    small_rows: int = 0      # products of at most this many rows through small_linear's kernel

    @classmethod
    def from_linear(cls, lin: nn.Linear, small_rows: int = 0) -> "PackedLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias      # the same Parameters: ties and checkpoints hold
        new.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), BATCH_HINT)
        new.small_rows = small_rows if lin.weight.is_contiguous() else 0
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type != "cpu" or x.dtype != self.packed.dtype
                or (torch.is_grad_enabled() and self.weight.requires_grad)):
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.size(-1)
        if rows <= self.small_rows:
            return small_linear(x, self.weight, None, self.bias)
        least, most = ROWS[self.packed.dtype]      # pack_linears packs fp32 and bf16 weights only
        if not least <= rows <= most:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, min_weight: int | None = None, small_rows: bool = True) -> int:
    """Replace every fp32 nn.Linear of `model` (on the CPU) with at least `min_weight` weight elements (default
    MIN_WEIGHT, read when called), and every bf16 one (at least `min_weight` if given), by a PackedLinear, in
    place -> how many. `small_rows`: products of up to SMALL_ROWS rows through small_linear's kernel where it
    builds. Raises what oneDNN raises if it cannot pack (the caller falls back to torch's own path)."""
    if not available():
        raise RuntimeError("torch was built without oneDNN (mkldnn)")
    least = {torch.float32: MIN_WEIGHT if min_weight is None else min_weight,
             torch.bfloat16: 0 if min_weight is None else min_weight}
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cpu"
               and child.weight.dtype in least and child.weight.numel() >= least[child.weight.dtype]]
    packed = {}
    for parent, name, child in targets:          # a module listed under two parents is packed once
        if id(child) not in packed:
            few = (SMALL_ROWS.get(child.weight.dtype, 0) if small_rows and child.weight.numel() >= SMALL_MIN_WEIGHT
                   and small_kernel() is not None else 0)
            packed[id(child)] = PackedLinear.from_linear(child, few)
        setattr(parent, name, packed[id(child)])
    return len(packed)

