"""The KV cache as a pool of fixed-size blocks, and where one forward pass reads and writes in it.

The model's layers fall in groups of equal size, one attention kind each (LayerGroups: one group for a model
without sliding windows; nanochat's SSSL pattern gives full-context groups and window groups). A block holds one
group's layers: per place in a group, (blocks, kv_heads, block_size, head_dim). A sequence has a block table per
group: position p lies at block table[p // block_size], offset p % block_size. Sequences that share a prefix list
the same blocks (block_pool.py decides which ids a sequence gets, and which it shares); nothing is copied for a
prefix-cache hit. A window group gives back the blocks its window has left (the scheduler), so a sequence holds
at most its window there; memory per stored token is the floor: 2 x layers x kv_heads x head_dim x bytes per
element, plus the unfilled end of each sequence's last blocks.

The pool is allocated once at its full size (`chat_kv_cache_memory`) but touched lazily: a block's memory is
zeroed the first time it is handed out, so on a CPU the resident memory is what has been used (a torch.empty
of gigabytes costs nothing until written), and every position a masked read may see holds a finite value.
Block 0 is scratch: padded positions are written there and block tables are padded with it.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

import torch

from .block_pool import SCRATCH


@dataclass(frozen=True)
class LayerGroups:
    """The model's layers in groups of equal size, each group of one attention kind (full context, or one sliding
    window): a block holds one group's layers, and a sequence has a block table per group, so a sliding-window
    group can give back the blocks its window has left while a full group keeps every position (vLLM's hybrid
    KV cache manager). A model without windows has one group of every layer."""

    windows: tuple[int | None, ...]               # per group: the window of its layers (None: full context)
    layers: tuple[tuple[int, ...], ...]           # per group: its layers, in order
    slot: tuple[tuple[int, int], ...]             # per layer: (its group, its place in the group)

    @classmethod
    def of(cls, layer_windows: list[int | None]) -> "LayerGroups":
        kinds: dict[int | None, list[int]] = {}
        for i, w in enumerate(layer_windows):
            kinds.setdefault(w, []).append(i)
        size = math.gcd(*(len(v) for v in kinds.values()))
        windows, layers = [], []
        for w in sorted(kinds, key=lambda w: (w is not None, w or 0)):       # full-context groups first
            for k in range(0, len(kinds[w]), size):
                windows.append(w)
                layers.append(tuple(kinds[w][k:k + size]))
        slot = [None] * len(layer_windows)
        for g, ls in enumerate(layers):
            for j, i in enumerate(ls):
                slot[i] = (g, j)
        return cls(tuple(windows), tuple(layers), tuple(slot))

    @property
    def size(self) -> int:
        return len(self.layers[0])

    def __len__(self) -> int:
        return len(self.layers)


class KVCache:
    def __init__(self, groups: LayerGroups, n_blocks: int, n_kv_head: int, head_dim: int, block_size: int,
                 max_len: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if block_size % 4:
            raise ValueError(f"the KV cache's block size must be a multiple of 4 (the decode kernel reads keys in "
                             f"fours), got {block_size}")
        self.groups = groups
        self.n_layer = sum(len(ls) for ls in groups.layers)
        self.n_blocks, self.n_kv_head, self.head_dim = n_blocks, n_kv_head, head_dim
        self.block_size, self.max_len = block_size, max_len
        self.max_blocks = -(-max_len // block_size)      # a table's longest length
        self.dtype, self.device = dtype, torch.device(device)
        # a block holds one group's layers: place j of every group shares one tensor
        shape = (groups.size, n_blocks, n_kv_head, block_size, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=self.device)
        self.v = torch.empty(shape, dtype=dtype, device=self.device)
        self._zeroed = 0                                  # blocks below this hold finite values
        self.touch(SCRATCH + 1)

    @staticmethod
    def block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes: one group's layers, keys and values."""
        size = LayerGroups.of(config.layer_windows).size
        return 2 * size * config.n_kv_head * config.head_dim * block_size * dtype.itemsize

    @classmethod
    def for_model(cls, config, n_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                  device="cpu") -> "KVCache":
        return cls(LayerGroups.of(config.layer_windows), n_blocks, config.n_kv_head, config.head_dim, block_size,
                   config.sequence_len, dtype, device)

    def layer(self, layer: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """A layer's group and its keys and values: (group, K, V), K and V (blocks, kv_heads, block_size, D)."""
        g, j = self.groups.slot[layer]
        return g, self.k[j], self.v[j]

    def touch(self, upto: int) -> None:
        """Blocks below `upto` are about to be used: zero those never zeroed (once each)."""
        if upto > self._zeroed:
            self.k[:, self._zeroed:upto] = 0
            self.v[:, self._zeroed:upto] = 0
            self._zeroed = upto

    def copy_block(self, src: int, dsts: list[int]) -> None:
        """Block `src`'s keys and values, every layer of its group, into each of `dsts` (a partly filled last
        block that another sequence will write on: copy on write)."""
        if dsts:
            idx = torch.tensor(dsts, device=self.device)
            self.k[:, idx] = self.k[:, src:src + 1].clone()
            self.v[:, idx] = self.v[:, src:src + 1].clone()

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def tables(self, n: int, length: int) -> list[list[list[int]]]:
        """Block tables (per group) for `n` sequences of up to `length` positions in disjoint blocks 1, 2, ...
        (tests and benchmarks that address the cache without a pool)."""
        per, G = -(-length // self.block_size), len(self.groups)
        if 1 + G * n * per > self.n_blocks:
            raise ValueError(f"{n} sequences of {length} positions need {1 + G * n * per} blocks; the cache has "
                             f"{self.n_blocks}")
        self.touch(1 + G * n * per)
        return [[list(range(1 + (i * G + g) * per, 1 + (i * G + g + 1) * per)) for g in range(G)]
                for i in range(n)]


def find_shared_prefixes(tables: list[list[int]], positions: list[int],
                         block_size: int) -> tuple[list[int], list[int]] | None:
    """For decode entries with these block tables, whose next key goes at `positions`: entries whose tables begin
    with the same blocks (a prefix-cache hit, n samples of one prompt) read those keys once for the group. ->
    (leaders, shared): per entry, the batch index whose table the group reads its shared keys from, and how many
    keys (whole blocks, below each member's position) it shares; 0 for an entry in no group. None when no two
    entries share a block."""
    groups: dict[int, list[int]] = {}
    for b, t in enumerate(tables):
        if t and positions[b] >= block_size:
            groups.setdefault(t[0], []).append(b)
    leaders, shared = list(range(len(tables))), [0] * len(tables)
    found = False
    for members in groups.values():
        if len(members) < 2:
            continue
        lead = tables[members[0]]
        common = min(positions[b] for b in members) // block_size
        for b in members[1:]:
            t, n = tables[b], 0
            while n < common and t[n] == lead[n]:
                n += 1
            common = n
        if not common:
            continue
        found = True
        for b in members:
            leaders[b], shared[b] = members[0], common * block_size
    return (leaders, shared) if found else None


def padded_tables(tables: list[list[int]], width: int) -> torch.Tensor:
    """Block tables as one (len(tables), width) int64 tensor, cut or padded with the scratch block. Built through
    an array: torch.tensor on nested lists took 238 us for 32 tables of 44 blocks (every decode step), this 78."""
    flat = array("q")
    pad = [SCRATCH] * width
    for t in tables:
        flat.extend(t[:width])
        flat.extend(pad[:width - min(len(t), width)])
    return torch.frombuffer(flat, dtype=torch.int64).view(len(tables), width)


@dataclass
class CacheBatch:
    """Where one forward pass reads and writes in the cache: computed once per pass, shared by every layer. Per
    layer group (LayerGroups): the entries' block tables and the slots of their new tokens."""

    cache: KVCache
    tables: list[torch.Tensor]    # per group: (B, blocks) each entry's block table, padded with the scratch block
    slots: list[torch.Tensor]     # per group: (B, T) where each input token's key goes: block * block_size + offset
    positions: torch.Tensor       # (B, T) absolute position of each input token
    mask: torch.Tensor | None     # (B, 1, T, L) True where a query may attend; None: made when a path needs it
    length: int                   # L: keys read per entry (the longest entry's end)
    # (B,) the token just before each entry's first input, -1 at position 0: a model that mixes in the previous
    # token (nanochat's smear) reads it here at an entry's first new position. None: not given, which such a
    # model accepts only when every entry starts at 0 (`starts_at_zero`).
    previous: torch.Tensor | None = None
    starts: list[int] | None = None       # each entry's first position (build's `start`); None: not known here
    lengths: list[int] | None = None      # each entry's real input tokens (the rest of T is right padding)
    table_lists: list[list[list[int]]] | None = None   # per group, the tables as given
    # decode, per group: (leaders, shared) tensors, (B,) each; None: no two entries share a prefix there, or the
    # pass does not read them so (find_shared_prefixes)
    shared: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    threads: int = 0                      # torch threads for the pass's attention on a CPU (0: as they are)
    # decode: the model's blocks prepared for one call (decode_stack.GPT2Stack; EngineConfig.fused_decode), which
    # a pass of at most its `rows` rows runs instead of the modules; None: the modules
    fused: object | None = None
    _windowed: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cache: KVCache, tables: list[list[list[int]]], start: list[int], T: int,
              previous: list[int] | None = None, shared_prefixes: bool = False, threads: int = 0,
              lengths: list[int] | None = None, fused: object | None = None) -> "CacheBatch":
        """tables: each entry's block tables, one per layer group, covering its positions start .. start + its
        length - 1 (a sliding-window group's may hold the scratch block where its window has passed). previous:
        the token before each entry's `start` (-1 where start is 0); needed when an entry starts later and the
        model reads it (ChatNetwork.needs_previous). shared_prefixes: look up the prefixes the entries share in
        each full-context group (for decode attention that reads them once). lengths: the real tokens of each
        entry (default T); the padding after them is written to the scratch block and never read."""
        device, bs = cache.device, cache.block_size
        lengths = list(lengths) if lengths is not None else [T] * len(tables)
        end = max(s0 + n for s0, n in zip(start, lengths))
        if end > cache.max_len:
            raise ValueError(f"a pass reaches position {end - 1}; the model's sequence length is {cache.max_len}")
        width = max(1, -(-end // bs))
        for t, s0, n in zip(tables, start, lengths):
            if len(t[0]) * bs < s0 + n:
                raise ValueError(f"a block table of {len(t[0])} blocks cannot hold positions up to {s0 + n - 1}")
        positions = torch.tensor(start, device=device)[:, None] + torch.arange(T, device=device)[None, :]
        positions = positions.clamp_(max=cache.max_len - 1)
        real = torch.arange(T, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
        index, offset = (positions // bs).clamp_(max=width - 1), positions % bs
        per_group = [[t[g] for t in tables] for g in range(len(cache.groups))]
        padded, slots = [], []
        for group in per_group:
            table = padded_tables(group, width).to(device)
            padded.append(table)
            slots.append(torch.where(real, table.gather(1, index) * bs + offset, SCRATCH * bs))
        prev = torch.tensor(previous, device=device) if previous is not None else None
        shared = None
        if shared_prefixes and T == 1 and len(tables) > 1:
            shared = []
            for g, group in enumerate(per_group):
                found = find_shared_prefixes(group, start, bs) if cache.groups.windows[g] is None else None
                shared.append(None if found is None else (torch.tensor(found[0]), torch.tensor(found[1])))
        return cls(cache, padded, slots, positions, None, end, prev, list(start), lengths, per_group, shared,
                   threads, fused=fused if T == 1 else None)

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

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (B, Hkv, T, D) for the new tokens, written at each entry's slots (where the CPU kernel's
        write_kv is not used: attention.py)."""
        g, K, V = self.cache.layer(layer)
        bs = self.cache.block_size
        blocks, offsets = self.slots[g] // bs, self.slots[g] % bs
        K[blocks, :, offsets] = k.transpose(1, 2).to(K.dtype)
        V[blocks, :, offsets] = v.transpose(1, 2).to(V.dtype)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass's entries' keys and values of a layer, gathered from their blocks: (B, Hkv, L, D) each."""
        g, K, V = self.cache.layer(layer)
        B, n = self.tables[g].shape
        Hkv, bs, D = K.shape[1], K.shape[2], K.shape[3]

        def gather(X: torch.Tensor) -> torch.Tensor:
            return X[self.tables[g]].transpose(1, 2).reshape(B, Hkv, n * bs, D)[:, :, :self.length]

        return gather(K), gather(V)

    def entry(self, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entry b's first `length` keys and values of a full-context layer, (1, Hkv, length, D) each: a view of
        its block when they lie in one, else gathered."""
        g, K, V = self.cache.layer(layer)
        bs = self.cache.block_size
        blocks = self.table_lists[g][b][:-(-length // bs)]
        if len(blocks) == 1:
            return K[blocks[0], :, :length].unsqueeze(0), V[blocks[0], :, :length].unsqueeze(0)
        idx = torch.tensor(blocks, device=K.device)
        Hkv, D = K.shape[1], K.shape[3]

        def gather(X: torch.Tensor) -> torch.Tensor:
            return X[idx].transpose(0, 1).reshape(1, Hkv, len(blocks) * bs, D)[:, :, :length]

        return gather(K), gather(V)
