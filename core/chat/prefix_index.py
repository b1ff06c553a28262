"""KV-cache rows and the prefixes they hold: which row a request gets, and how much of its prompt is there.

A row of the engine's KV cache holds the keys and values of the tokens fed into it. When a request ends, its
rows keep them: the pool indexes each free row by those token ids, and a later prompt that starts with the
same ids (the next turn of a conversation resends the whole history) reuses them instead of computing them
again. Rows of running requests are indexed by their prompt once it is prefilled: they can be copied from,
never taken (their owner still writes to them). The few-shot prefix sits in a pinned row that is never
evicted or taken. Free rows that hold something are evicted least recently used first when a request needs a
row, so memory stays what it always was: the number of rows.

Matching is by token ids, in blocks of `BLOCK` tokens: each indexed row registers the chained hash of every
full block of its tokens; a prompt walks its own chain while some row shares it, then compares the last
partial block token by token, and the winner is verified against the row's token list (so a hash collision
can only cost a hit, never reuse wrong keys).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

BLOCK = 16


@dataclass
class Match:
    row: int             # the row holding the prefix (-1: none)
    length: int          # tokens of the prompt it holds
    free: bool           # the row is free (it can be taken over) rather than held or pinned


class RowPool:
    def __init__(self, rows: int):
        self.rows = rows
        self.free: set[int] = set(range(rows))          # not held by a request (empty or caching a prefix)
        self.tokens: dict[int, list[int]] = {}           # indexed row -> the token ids it holds
        self.pinned: set[int] = set()
        self._blocks: dict[int, set[int]] = {}           # chained block hash -> indexed rows sharing that prefix
        self._row_hashes: dict[int, list[int]] = {}
        self._clock = itertools.count()
        self._used: dict[int, int] = {}                  # free indexed row -> last use, for LRU eviction
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---- the index
    @staticmethod
    def _chain(tokens: list[int]) -> list[int]:
        out, h = [], 0
        for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
            h = hash((h, tuple(tokens[i:i + BLOCK])))
            out.append(h)
        return out

    def _index(self, row: int, tokens: list[int]) -> None:
        self._unindex(row)
        if not tokens:
            return
        self.tokens[row] = list(tokens)
        hashes = self._chain(tokens)
        self._row_hashes[row] = hashes
        for h in hashes:
            self._blocks.setdefault(h, set()).add(row)

    def _unindex(self, row: int) -> None:
        self.tokens.pop(row, None)
        self._used.pop(row, None)
        for h in self._row_hashes.pop(row, []):
            rows = self._blocks.get(h)
            if rows is not None:
                rows.discard(row)
                if not rows:
                    del self._blocks[h]

    def match(self, prompt: list[int], limit: int, count: bool = True) -> Match:
        """The indexed row holding the longest prefix of `prompt` (at most `limit` tokens); ties go to a free row,
        then the most recently used. `count`: add it to the hit statistics (a lookup that admits the prompt)."""
        if count:
            self.query_tokens += len(prompt)
        candidates, matched, h = set(self.tokens), 0, 0
        for i in range(0, min(len(prompt), limit) - BLOCK + 1, BLOCK):
            h = hash((h, tuple(prompt[i:i + BLOCK])))
            rows = self._blocks.get(h)
            if not rows:
                break
            candidates, matched = rows, i + BLOCK
        best = Match(-1, 0, False)
        for row in candidates:
            toks = self.tokens[row]
            n, end = matched, min(len(toks), len(prompt), limit)
            while n < end and toks[n] == prompt[n]:
                n += 1
            key = (n, row in self.free, self._used.get(row, -1))
            if n and key > (best.length, best.free, self._used.get(best.row, -1)):
                best = Match(row, n, row in self.free)
        if best.row >= 0 and self.tokens[best.row][:best.length] != prompt[:best.length]:
            return Match(-1, 0, False)              # a hash collision: no reuse
        if count:
            self.hit_tokens += best.length
        return best

    # ---- rows
    def pin(self, row: int, tokens: list[int]) -> None:
        """Keep `tokens` in `row` for good: it is matched (as a source to copy from) but never given out."""
        self.free.discard(row)
        self.pinned.add(row)
        self._index(row, tokens)

    def take(self, row: int) -> None:
        """A request takes over a free row that holds a prefix it matched; the row leaves the index."""
        assert row in self.free and row not in self.pinned
        self.free.discard(row)
        self._unindex(row)

    def allocate(self, keep: int = -1) -> int:
        """A free row for a request: an empty one if there is one, else the least recently used cached one (whose
        prefix is dropped). `keep` is never chosen."""
        empty = [r for r in self.free if r not in self.tokens and r != keep]
        if empty:
            row = min(empty)
        else:
            row = min((r for r in self.free if r != keep), key=lambda r: self._used.get(r, -1))
            self._unindex(row)
        self.free.discard(row)
        return row

    def hold(self, row: int, tokens: list[int]) -> None:
        """A held row's first `tokens` are final (its prompt is prefilled): other requests may copy them."""
        self._index(row, tokens)

    def release(self, row: int, tokens: list[int]) -> None:
        """A request lets go of `row`, whose keys and values are valid for `tokens`: the row is free and caches
        them until it is evicted or taken over."""
        self.free.add(row)
        self._index(row, tokens)
        if tokens:
            self._used[row] = next(self._clock)

    @property
    def n_free(self) -> int:
        return len(self.free)

    @property
    def cached_rows(self) -> int:
        """Free rows that hold a prefix."""
        return sum(1 for r in self.free if r in self.tokens)

    def cached_tokens(self) -> int:
        return sum(len(self.tokens[r]) for r in self.free if r in self.tokens)
