"""The KV cache's blocks: who holds which, and which prefixes they cache. No torch.

The cache (kv_cache.py) is a pool of fixed-size blocks of `block_size` positions. Its layers fall in groups
(one group for a model without sliding windows; see kv_cache.LayerGroups): a block holds one group's layers, and
a sequence has one block table per group, the block ids that hold its positions in order. This module decides
which ids a sequence gets.

- Reference counts: a block is held by every sequence whose table lists it. Sequences that begin with the same
  tokens (a prefix-cache hit, the n samples of one prompt) list the same ids: the keys are stored once.
- The prefix cache: a block that is full is final (no sequence writes below its end again) and is registered
  under its group and the digest of its tokens and every token before them (`chain`: blake2b over the previous
  block's digest and this block's token ids; the key also holds the token ids, so two keys are equal only for
  equal tokens after an equal 128-bit digest). Keys depend on tokens alone, not on which blocks are still cached,
  so a sliding-window group finds the blocks of its window even after the blocks before them were reused.
- Eviction: a block nobody holds goes to the free queue. Blocks that cache nothing are used first; then the
  least recently released cached block is evicted (its key dropped). A sequence's blocks are released last
  first, so a cached conversation loses its tail before its beginning. Blocks never handed out are taken before
  any queued one, so a cached prefix is kept for as long as memory allows.

Block 0 is never handed out: padded positions and the table entries of positions a sliding window has left
point at it (kv_cache.py's scratch block).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable

SCRATCH = 0
ROOT = b""          # the digest before a sequence's first block


def chain(tokens: list[int], block_size: int, digests: list[bytes]) -> list[bytes]:
    """The digests of `tokens`' full blocks, extending `digests` (those of its first blocks, computed before)."""
    prev = digests[-1] if digests else ROOT
    for i in range(len(digests) * block_size, len(tokens) - block_size + 1, block_size):
        prev = hashlib.blake2b(prev + array("q", tokens[i:i + block_size]).tobytes(), digest_size=16).digest()
        digests.append(prev)
    return digests


class BlockPool:
    def __init__(self, n_blocks: int, block_size: int, on_evict: Callable[[tuple], None] | None = None):
        if n_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is scratch), got {n_blocks}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.ref = [0] * n_blocks
        self._fresh = 1                                  # blocks from here on were never handed out
        # held by nobody and handed out before: uncached ones first (they cost nothing to reuse), then cached ones
        # from the least recently released
        self._queue: OrderedDict[int, None] = OrderedDict()
        self.key_of: dict[int, tuple] = {}               # cached block -> its key (group, digest)
        self._cached: dict[tuple, int] = {}              # key -> block
        self.on_evict = on_evict                         # called with the key of a cached block that is reused
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
    def cached(self, group: int, digest: bytes) -> int | None:
        """The block caching this group's block of this digest, if any (not taken: take() it)."""
        return self._cached.get((group, digest))

    def commit(self, group: int, blocks: list[int], digests: list[bytes], start: int, end: int) -> None:
        """Register a sequence's full blocks start..end-1 of one group (`blocks`, its table there; `digests`, its
        full blocks' digests). A block whose key another block already caches stays private (freed as it is when
        released); the scratch block (a position a window has left) is skipped."""
        for i in range(start, end):
            block = blocks[i]
            if block == SCRATCH or block in self.key_of:
                continue
            key = (group, digests[i])
            if key not in self._cached:
                self.key_of[block] = key
                self._cached[key] = block

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
        samples share; scratch entries skipped)."""
        for b in blocks:
            if b == SCRATCH:
                continue
            if self.ref[b] == 0:
                del self._queue[b]
                self.cached_blocks -= b in self.key_of
            self.ref[b] += 1

    def release(self, blocks: list[int]) -> None:
        """A holder lets go of `blocks` (a table, in order; scratch entries skipped): blocks nobody holds are
        queued, cached ones as the most recently used (the table's end before its start), the others to be reused
        first."""
        for b in reversed(blocks):
            if b == SCRATCH:
                continue
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
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)
