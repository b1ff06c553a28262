"""The KV cache's blocks: who holds which, and which prefixes they cache. No torch.

The cache (kv_cache.py) is a pool of fixed-size blocks of `block_size` positions; a sequence is the list of
block ids that hold its positions in order (its block table). This module decides which ids a sequence gets.

- Reference counts: a block is held by every sequence whose table lists it. Sequences that begin with the same
  tokens (a prefix-cache hit, the n samples of one prompt) list the same ids: the keys are stored once.
- The prefix cache: a block that is full is final (no sequence writes below its end again) and is registered
  under a key made of its tokens and its parent's identity: (the content id of the block before it, the block's
  token ids). Content ids are never reused, so a key names one exact token sequence from position 0: a lookup
  walks a prompt's full blocks while their keys are registered, with no hash to collide.
- Eviction: a block nobody holds goes to the free queue. Blocks that cache nothing are used first; then the
  least recently released cached block is evicted (its key dropped; keys of its children can no longer be
  reached and go when those blocks are reused). A sequence's blocks are released last first, so a cached
  conversation loses its tail before its beginning. Blocks never handed out are taken before any queued one,
  so a cached prefix is kept for as long as memory allows.

Block 0 is never handed out: padded positions and table padding point at it (kv_cache.py's scratch block).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable

SCRATCH = 0
ROOT = 0          # the parent content id of a sequence's first block


class BlockPool:
    def __init__(self, n_blocks: int, block_size: int, on_evict: Callable[[int], None] | None = None):
        if n_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is scratch), got {n_blocks}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.ref = [0] * n_blocks
        self._fresh = 1                                  # blocks from here on were never handed out
        # held by nobody and handed out before: uncached ones first (they cost nothing to reuse), then cached ones
        # from the least recently released; the value says which
        self._queue: OrderedDict[int, None] = OrderedDict()
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}   # cached block -> its key
        self.cid_of: dict[int, int] = {}                 # cached block -> its content id
        self._cached: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> block
        self._cids = itertools.count(1)
        self.on_evict = on_evict                         # called with a content id whose block is reused
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        self.cached_blocks = 0                           # queued blocks that cache a prefix

    # ---- counts
    @property
    def usable(self) -> int:
        """Blocks a sequence can ever hold (all but the scratch block)."""
        return self.n_blocks - 1

    @property
    def available(self) -> int:
        """Blocks that an allocation can have now: never used, free, or cached and held by nobody."""
        return self.n_blocks - self._fresh + len(self._queue)

    @property
    def in_use(self) -> int:
        return self.usable - self.available

    @property
    def touched(self) -> int:
        """Blocks ever handed out (1 + the highest id): what the cache's memory has had to hold."""
        return self._fresh

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    # ---- the prefix cache
    def match(self, tokens: list[int], limit: int, count: bool = True) -> list[int]:
        """The cached blocks that hold the longest prefix of `tokens` in full blocks, at most `limit` tokens; not
        taken (take() them). `count`: add the lookup to the hit statistics."""
        bs, out, parent = self.block_size, [], ROOT
        for i in range(0, min(len(tokens), limit) - bs + 1, bs):
            block = self._cached.get((parent, tuple(tokens[i:i + bs])))
            if block is None:
                break
            out.append(block)
            parent = self.cid_of[block]
        if count:
            self.query_tokens += len(tokens)
            self.hit_tokens += len(out) * bs
        return out

    def commit(self, blocks: list[int], tokens: list[int], start: int) -> int:
        """Register the full blocks of a sequence (`blocks`, its table; `tokens`, what its positions hold) from
        block index `start` on; -> how many of its blocks are registered now. A block whose key another block
        already caches stays unregistered (it is freed as it is when released), and so do the blocks after it."""
        bs = self.block_size
        full = min(len(tokens) // bs, len(blocks))
        parent = self.cid_of.get(blocks[start - 1], None) if start else ROOT
        i = start
        while i < full and parent is not None:
            block = blocks[i]
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if block not in self.key_of:
                if key in self._cached:
                    break
                cid = next(self._cids)
                self.key_of[block], self.cid_of[block] = key, cid
                self._cached[key] = block
            elif self.key_of[block] != key:
                break
            parent = self.cid_of[block]
            i += 1
        return i

    # ---- holding blocks
    def allocate(self, n: int) -> list[int] | None:
        """n blocks for one holder (never used first, then free, then the least recently used cached ones, whose
        keys are dropped); None, and nothing taken, when fewer are available."""
        if n > self.available:
            return None
        out = []
        while len(out) < n and self._fresh < self.n_blocks:
            out.append(self._fresh)
            self._fresh += 1
        while len(out) < n:
            block, _ = self._queue.popitem(last=False)
            self._forget(block)
            out.append(block)
        for b in out:
            self.ref[b] = 1
        return out

    def take(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks` (cached blocks a prefix hit shares, a prompt's blocks its other
        samples share)."""
        for b in blocks:
            if self.ref[b] == 0:
                del self._queue[b]
                self.cached_blocks -= b in self.key_of
            self.ref[b] += 1

    def release(self, blocks: list[int]) -> None:
        """A holder lets go of `blocks` (a sequence's table, in order): blocks nobody holds are queued, cached ones
        as the most recently used (the table's end before its start), the others to be reused first."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self._queue[b] = None
                if b in self.key_of:
                    self.cached_blocks += 1
                else:
                    self._queue.move_to_end(b, last=False)

    def _forget(self, block: int) -> None:
        key = self.key_of.pop(block, None)
        if key is None:
            return
        self.cached_blocks -= 1
        del self._cached[key]
        cid = self.cid_of.pop(block)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(cid)
