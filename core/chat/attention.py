"""Attention through the KV cache: how a pass's queries read the keys and values of their sequences.

A pass with a cache (core/chat/kv_cache.py's `CacheBatch`) first writes its new keys and values at each entry's
positions; then:

- decode on a CPU (one new token an entry): csrc/cache_attention.cpp reads each entry's keys and values where
  they lie, block by block through its block table, from the first key the layer's window lets the query see to
  its own position. Nothing is gathered, nothing is padded to the longest entry, no mask is built; an entry's
  result does not depend on its batch. Entries whose tables begin with the same blocks (a prefix-cache hit, n
  samples of a prompt) read those blocks once for all of them (cascade attention), with the same bits as alone.
  The kernel is compiled once per machine on first use (torch's cpp_extension, into its extensions cache);
- prefill on a CPU (where the kernel is built): torch's SDPA once per entry, over its own keys (gathered from its
  blocks; the causal pass from position 0, bottom-right-aligned after a cached prefix), real tokens only;
- everything else (windowed layers' prefill, CUDA, a machine where the kernel cannot be built): torch's SDPA
  over the entries' keys gathered from their blocks, under the pass's mask.

`path()` says which one decode takes here ("cpu-kernel" or "sdpa"); the engine reports it in its stats, and a
failed build logs why, once.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .extensions import extension
from .kv_cache import CacheBatch


_NONE = torch.empty(0, dtype=torch.long)      # no shared prefixes


def kernel():
    """The compiled decode kernel, or None where it cannot be built (then one warning says why)."""
    return extension("startlux_cache_attention", "cache_attention.cpp",
                     "decode attention stays on torch's SDPA (slower: it gathers each entry's blocks)")


@contextlib.contextmanager
def threads(n: int):
    """torch's intra-op threads set to `n` for the block (0: left as they are; EngineConfig.attention_threads).
    Attention reads the cache at the memory's rate, which one core does not reach: a second thread for it alone
    cut a decode step at 768 positions from 8.9-11 to 6-7 ms (bench/README.md), where the linear layers' small
    products gain little from one. Setting the count costs ~0.1 us."""
    before = torch.get_num_threads()
    if not n or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def path(device: torch.device) -> str:
    return "cpu-kernel" if device.type == "cpu" and kernel() is not None else "sdpa"


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: CacheBatch,
                    window: int | None) -> torch.Tensor:
    """q (B, H, T, D), the pass's new k/v (B, Hkv, T, D) -> (B, H, T, D): the new keys and values written into
    the cache, then each query over its entry's keys up to its own position (from position - window on)."""
    mod = kernel() if q.device.type == "cpu" else None
    g, keys, values = cache.cache.layer(layer)
    if mod is not None and k.dtype == keys.dtype:
        mod.write_kv(keys, values, k.contiguous(), v.contiguous(), cache.slots[g])
    else:
        cache.write(layer, k, v)
    B, H, T, D = q.shape
    if T == 1 and mod is not None and q.dtype == keys.dtype:
        shared = cache.shared[g] if cache.shared is not None else None
        leaders, lengths = shared if shared is not None else (_NONE, _NONE)
        with threads(cache.threads):
            out = mod.decode_attention(q.reshape(B, H, D).contiguous(), keys, values, cache.tables[g],
                                       cache.positions[:, 0], -1 if window is None else window, D ** -0.5,
                                       leaders, lengths)
        return out.view(B, H, 1, D)
    if mod is not None and T > 1 and window is None and cache.starts is not None and cache.lengths is not None:
        with threads(cache.threads):
            return prefill_in_place(q, layer, cache)
    keys, values = cache.read(layer)
    lo = cache.window_start(window)       # a windowed layer reads only the keys its queries can see
    return F.scaled_dot_product_attention(q, keys[:, :, lo:].to(q.dtype), values[:, :, lo:].to(q.dtype),
                                          attn_mask=cache.mask_for(window), enable_gqa=H != k.size(1))


def prefill_in_place(q: torch.Tensor, layer: int, cache: CacheBatch) -> torch.Tensor:
    """A prefill pass's queries, each entry over its own keys (CacheBatch.entry: a view of its block when its keys
    lie in one, else its blocks gathered): from position 0 the causal pass, after a cached prefix the
    bottom-right-aligned causal one (query t sees keys up to start + t). Padded queries are not computed (their
    outputs are zeros, never used)."""
    B, H, T, D = q.shape
    gqa = H != cache.cache.n_kv_head
    out = q.new_zeros(q.shape) if any(n < T for n in cache.lengths) else torch.empty_like(q)
    for b, (start, n) in enumerate(zip(cache.starts, cache.lengths)):
        k, v = cache.entry(layer, b, start + n)
        qb = q[b:b + 1, :, :n]
        if start == 0:
            out[b:b + 1, :, :n] = F.scaled_dot_product_attention(qb, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out[b:b + 1, :, :n] = F.scaled_dot_product_attention(qb, k, v, attn_mask=causal_lower_right(n, start + n),
                                                                 enable_gqa=gqa)
    return out
