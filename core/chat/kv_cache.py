"""A preallocated key/value cache with one row per running sequence.

Layout per layer: (rows, kv_heads, capacity, head_dim). The model writes a batch's keys and values
at each row's own positions and attends over the prefix of its rows; the engine, not the model,
owns the per-row lengths. Capacity starts small and grows (by allocating and copying, so contents
survive; `resize_` would scramble them) up to the model's sequence length; the
number of rows is fixed, which is what bounds memory.

The cache also knows which rows begin with copies of another row's keys (`copy_rows`: a prefix-cache hit
copied in, the n samples of one prompt) and for how many positions they still do: a write below that length,
into either row, shortens it. A decode pass on the CPU reads such a shared prefix once for all the rows that
hold it (`shared_prefixes`, csrc/cache_attention.cpp).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MIN_SHARED = 16          # a shared prefix shorter than this is not worth grouping rows for


class KVCache:
    def __init__(self, n_layer: int, rows: int, n_kv_head: int, head_dim: int, max_len: int,
                 initial_len: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.n_layer, self.rows, self.n_kv_head, self.head_dim = n_layer, rows, n_kv_head, head_dim
        self.max_len = max_len
        self.dtype, self.device = dtype, torch.device(device)
        cap = min(max_len, initial_len or max_len)
        self.k = torch.zeros(n_layer, rows, n_kv_head, cap, head_dim, dtype=dtype, device=self.device)
        self.v = torch.zeros_like(self.k)
        self.filled = [0] * rows                      # per row: 1 + the last position of a real token written
        self.sources: dict[int, tuple[int, int]] = {}   # row -> (row it copied its first n positions from, n)

    @classmethod
    def for_model(cls, config, rows: int, initial_len: int | None = None, dtype=torch.float32,
                  device="cpu") -> "KVCache":
        return cls(config.n_layer, rows, config.n_kv_head, config.head_dim, config.sequence_len,
                   initial_len, dtype, device)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def ensure_capacity(self, length: int) -> None:
        """Make room for positions < length, keeping what is stored."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"KV cache length {length} exceeds the model's sequence length {self.max_len}")
        new_cap = min(self.max_len, max(length, 2 * self.capacity))
        shape = (self.n_layer, self.rows, self.n_kv_head, new_cap, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        k[:, :, :, :self.capacity] = self.k
        v[:, :, :, :self.capacity] = self.v
        self.k, self.v = k, v

    def copy_rows(self, src: int, dsts: list[int], length: int) -> None:
        """Copy the first `length` positions of row `src` into each row in `dsts` (n samples, one prefill)."""
        if not dsts or length == 0:
            return
        idx = torch.tensor(dsts, device=self.device)
        self.k[:, idx, :, :length] = self.k[:, src:src + 1, :, :length]
        self.v[:, idx, :, :length] = self.v[:, src:src + 1, :, :length]
        for d in dsts:
            self.written(d, 0, length)
            if length >= MIN_SHARED:
                self.sources[d] = (src, length)

    def written(self, row: int, start: int, end: int) -> None:
        """Positions start..end-1 of `row` are (about to be) written: a copy relation that covers them ends there.
        Rows that copied more than that from `row` still hold the same keys as each other: the one that copied
        most becomes the others' source."""
        if start < self.filled[row]:
            src = self.sources.get(row)
            if src is not None and src[1] > start:
                self._shorten(row, src[0], start)
            cut = sorted(((n, dst) for dst, (s, n) in self.sources.items() if s == row and n > start), reverse=True)
            if cut:
                n0, heir = cut[0]
                self._shorten(heir, row, start)
                for n, dst in cut[1:]:
                    self.sources[dst] = (heir, n)      # n <= n0: the heir holds them too
        self.filled[row] = max(self.filled[row], end)

    def _shorten(self, dst: int, src: int, n: int) -> None:
        if n >= MIN_SHARED:
            self.sources[dst] = (src, n)
        else:
            del self.sources[dst]

    def shared_prefixes(self, rows: list[int], positions: list[int]) -> tuple[list[int], list[int]] | None:
        """For each of `rows`, whose next key goes at `positions`: the row whose keys its first positions copy
        (following copies of copies back to the first; a row that others copy is its own) and how many positions
        before its next key it shares with that row; a row that shares with no other row of the batch gets 0.
        None when no two rows share."""
        if not self.sources:
            return None
        leaders, lengths = [], []
        for r, pos in zip(rows, positions):
            lead, n = r, pos
            for _ in range(len(self.sources)):     # a chain visits each row once (copies point to older rows)
                if lead not in self.sources:
                    break
                lead, m = self.sources[lead]
                n = min(n, m)
            leaders.append(lead)
            lengths.append(n)
        counts: dict[int, int] = {}
        for lead in leaders:
            counts[lead] = counts.get(lead, 0) + 1
        if not any(c > 1 for c in counts.values()):
            return None
        return leaders, [n if counts[lead] > 1 else 0 for lead, n in zip(leaders, lengths)]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class CacheBatch:
    """Where one forward pass reads and writes in the cache: computed once per pass, shared by every layer."""

    cache: KVCache
    rows: torch.Tensor            # (B,) row of each batch entry
    row_slice: slice | None       # the same rows as a slice when they are contiguous and ascending (no gather)
    positions: torch.Tensor       # (B, T) absolute position of each input token
    mask: torch.Tensor | None     # (B, 1, T, L) True where a query may attend; None: made when a path needs it
    length: int                   # L: keys read per row
    # (B,) the token just before each row's first input, -1 at position 0: a model that mixes in the previous
    # token (nanochat's smear) reads it here at a row's first new position. None: not given, which such a model
    # accepts only when every row starts at 0 (`starts_at_zero`).
    previous: torch.Tensor | None = None
    starts: list[int] | None = None       # each row's first position (build's `start`); None: not known here
    row_list: list[int] | None = None     # the rows, as given
    # decode: (leaders, shared) tensors, (B,) each: the row whose first shared[b] keys row b's copy (KVCache.
    # shared_prefixes); None: no two rows share a prefix, or the pass does not read them so
    shared: tuple[torch.Tensor, torch.Tensor] | None = None
    threads: int = 0                      # torch threads for the pass's attention on a CPU (0: as they are)
    _windowed: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cache: KVCache, rows: list[int], start: list[int], T: int,
              previous: list[int] | None = None, shared_prefixes: bool = False, threads: int = 0,
              lengths: list[int] | None = None) -> "CacheBatch":
        """previous: the token before each row's `start` (-1 where start is 0); needed when a row starts later
        and the model reads it (ChatNetwork.needs_previous). shared_prefixes: look up the prefixes the rows
        share (for decode attention that reads them once). lengths: the real tokens of each row (default T; the
        rest is right padding, written but never read before the row overwrites it, so the cache does not count
        it as written: the row's next write then continues where it really ends)."""
        device = cache.device
        end = min(max(start) + T, cache.max_len)
        cache.ensure_capacity(end)
        for r, s0, n in zip(rows, start, lengths or [T] * len(rows)):
            cache.written(r, s0, min(s0 + n, cache.max_len))
        shared = cache.shared_prefixes(rows, start) if shared_prefixes else None
        rows_t = torch.tensor(rows, device=device)
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        # Right-padded batches may run past the end of the cache with padding tokens: those positions are
        # clamped onto the last slot, which lies beyond every real token of the row and is overwritten before use.
        positions = torch.tensor(start, device=device)[:, None] + torch.arange(T, device=device)[None, :]
        positions = positions.clamp_(max=cache.max_len - 1)
        prev = torch.tensor(previous, device=device) if previous is not None else None
        return cls(cache, rows_t, slice(rows[0], rows[0] + len(rows)) if contiguous else None, positions, None,
                   end, prev, list(start), list(rows),
                   None if shared is None else (torch.tensor(shared[0]), torch.tensor(shared[1])), threads)

    @property
    def starts_at_zero(self) -> bool:
        return self.starts is not None and max(self.starts) == 0

    @property
    def first_position(self) -> int:
        """The smallest position of the pass: a windowed layer reads no key before first_position - window."""
        return min(self.starts) if self.starts is not None else 0

    def window_start(self, window: int | None) -> int:
        """The first key any query of this pass can see in a layer of `window`: the layer reads from there."""
        return 0 if window is None else max(0, self.first_position - window)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask of a layer whose queries see `window` earlier positions (None: all), over the keys from
        window_start(window) on; made once per pass, when a path first needs it (decode through the CPU kernel
        needs none)."""
        if self.mask is None:
            keys = torch.arange(self.length, device=self.positions.device)
            self.mask = (keys[None, None, :] <= self.positions[:, :, None])[:, None]
        if window is None:
            return self.mask
        m = self._windowed.get(window)
        if m is None:
            lo = self.window_start(window)
            keys = torch.arange(lo, self.length, device=self.positions.device)
            m = self._windowed[window] = self.mask[..., lo:] & (self.positions[:, None, :, None] - keys <= window)
        return m

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (B, Hkv, T, D) for the new tokens, written at each row's positions -> the layer's whole cache
        (rows, Hkv, capacity, D), keys and values (where the CPU kernel's write_kv is not used: attention.py)."""
        K, V = self.cache.k[layer], self.cache.v[layer]
        idx = (self.rows[:, None], slice(None), self.positions)
        K[idx] = k.transpose(1, 2).to(K.dtype)
        V[idx] = v.transpose(1, 2).to(V.dtype)
        return K, V

    def read(self, K: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass's rows of a layer's cache, (B, Hkv, L, D): a view when the rows are contiguous, else a copy."""
        if self.row_slice is not None:
            return K[self.row_slice, :, :self.length], V[self.row_slice, :, :self.length]
        return K[self.rows, :, :self.length], V[self.rows, :, :self.length]
