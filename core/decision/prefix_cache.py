"""The hybrid decision model's state after a prompt prefix, and a byte-bounded LRU of such states.

The questions of a request share the prompt's state block; only the question block (the tail) differs. The
model runs over the shared prefix once, and each question's tail continues from the state it left:

- each linear-attention (Gated DeltaNet) layer: its convolution state (the last `kernel` inputs) and its
  recurrent state, fixed-size tensors;
- each full-attention layer: the keys and values of the prefix's positions.

`PrefixState` holds those tensors for one prefix (batch of one). `batch_cache` puts several of them side by
side in one transformers `DynamicCache` for a pass over their tails: the linear-attention states are stacked
row by row, and the full-attention keys of shorter prefixes are left-padded to the longest and masked out, so
each row attends exactly to its own prefix and its position ids continue from its own length. Nothing is
ever padded inside a recurrent layer (padding there is not inert: a padded position still decays the state).
The stored tensors are never written to: a pass works on stacked copies.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class PrefixState:
    length: int                                   # prefix tokens
    kinds: list[str]                              # per layer: LINEAR or FULL
    tensors: list[tuple[torch.Tensor, torch.Tensor]]   # LINEAR: (conv, recurrent); FULL: (keys, values); batch 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.tensors for t in pair)

    @classmethod
    def capture(cls, cache: DynamicCache, kinds: list[str], length: int) -> "PrefixState":
        """The state a forward pass over the prefix left in `cache` (which the caller no longer uses)."""
        tensors = []
        for kind, layer in zip(kinds, cache.layers):
            if kind == LINEAR:
                tensors.append((layer.conv_states[0], layer.recurrent_states[0]))
            elif kind == FULL:
                tensors.append((layer.keys, layer.values))
            else:
                raise ValueError(f"layer type {kind!r}: only {LINEAR} and {FULL} layers are supported")
        return cls(length, list(kinds), tensors)


def batch_cache(config, states: list[PrefixState | None]) -> tuple[DynamicCache | None, int]:
    """One cache holding `states` as its rows (None: an empty prefix), and the common key length they are padded
    to. (None, 0) when every prefix is empty: the tails then run without a cache."""
    given = [s for s in states if s is not None and s.length > 0]
    if not given:
        return None, 0
    ref = given[0]
    longest = max(s.length for s in given)
    stacked = []
    for i, kind in enumerate(ref.kinds):
        a0, b0 = ref.tensors[i]
        rows_a, rows_b = [], []
        for s in states:
            if s is None or s.length == 0:
                if kind == LINEAR:          # a fresh recurrence: zero convolution inputs, zero state
                    rows_a.append(torch.zeros_like(a0))
                    rows_b.append(torch.zeros_like(b0))
                else:
                    shape = (1, a0.shape[1], longest, a0.shape[3])
                    rows_a.append(a0.new_zeros(shape))
                    rows_b.append(b0.new_zeros(shape))
                continue
            a, b = s.tensors[i]
            if kind == FULL and s.length < longest:
                pad = (0, 0, longest - s.length, 0)
                a, b = torch.nn.functional.pad(a, pad), torch.nn.functional.pad(b, pad)
            rows_a.append(a)
            rows_b.append(b)
        stacked.append((torch.cat(rows_a), torch.cat(rows_b)))
    return cache_of(config, ref.kinds, stacked), longest


def cache_of(config, kinds: list[str], tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache whose layers continue from `tensors` (per layer, rows side by side, full-attention keys already
    padded to one length). The given tensors are never written to: a linear-attention layer works on copies
    of its states, and a full-attention layer's update makes new key tensors. Every step is a tensor op, so it
    can run inside a CUDA graph capture (graphs.TailGraphs) over static buffers."""
    cache = DynamicCache(config=config)
    for kind, layer, (a, b) in zip(kinds, cache.layers, tensors):
        if kind == LINEAR:
            layer.lazy_initialization(conv_states=a, recurrent_states=b, conv_kernel_size=a.shape[-1])
            layer.conv_states[0].copy_(a)
            layer.recurrent_states[0].copy_(b)
            layer.has_previous_state[0] = True   # the next pass continues the recurrence
        else:   # what lazy_initialization sets, without its empty host tensors (no copy inside a capture)
            layer.dtype, layer.device = a.dtype, a.device
            layer.keys, layer.values = a, b
            layer.is_initialized = True
    return cache


class PrefixCache:
    """Prefix states by their token ids, least recently used out first, within `capacity_bytes` of tensors.

    Counters are in tokens, as vLLM's prefix-cache metrics are: `query_tokens` (prefix tokens looked up) and
    `hit_tokens` (of those, found)."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = int(capacity_bytes)
        self._entries: OrderedDict[tuple[int, ...], PrefixState] = OrderedDict()
        self.bytes = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return tuple(key) in self._entries

    def get(self, ids) -> PrefixState | None:
        key = tuple(ids)
        with self._lock:
            self.query_tokens += len(key)
            state = self._entries.get(key)
            if state is not None:
                self._entries.move_to_end(key)
                self.hit_tokens += len(key)
            return state

    def put(self, ids, state: PrefixState) -> None:
        key = tuple(ids)
        size = state.nbytes
        with self._lock:
            if key in self._entries or size > self.capacity_bytes:
                return
            while self._entries and self.bytes + size > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.nbytes
            self._entries[key] = state
            self.bytes += size

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "capacity_bytes": self.capacity_bytes,
                    "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens}
