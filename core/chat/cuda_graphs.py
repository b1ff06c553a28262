"""CUDA graphs for the engine's decode pass.

A decode step of a small model is a few hundred kernel launches that keep the GPU busy for a fraction of
the step (bench/README.md has the H200 profile); replaying a
recorded graph launches them all at once. Shapes must be static, so a graph is recorded per (batch bucket,
key-length bucket) on first use: its inputs are fixed-shape tensors (token ids, positions, previous tokens,
slots, and block tables as wide as the key-length bucket) copied in before each replay. The batch is padded with
entries whose table and slot point at the scratch block (their writes land there), and attention gathers the
bucket's keys through the tables under the usual mask, so padding never reaches a real entry's result. The
cache's blocks are allocated once, so the addresses a graph holds stay valid.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import CacheBatch, KVCache, padded_tables


class GraphCaptureError(RuntimeError):
    """Recording a graph failed; the caller runs the pass eagerly instead."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor      # (3 + groups, B) on the device: token ids, positions, previous tokens, then the slots
    tables: torch.Tensor      # (groups, B, blocks) on the device: the entries' block tables, to the bucket's length
    out: torch.Tensor         # (B, vocab) logits


def _ceil(buckets: list[int], n: int) -> int:
    return next(b for b in buckets if b >= n)


class DecodeGraphs:
    def __init__(self, model, cache: KVCache, max_batch: int):
        self.model, self.cache = model, cache
        self.batch_buckets = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch} | {max_batch})
        self.len_buckets = sorted({n for n in (128, 256, 512, 1024, 2048, 4096, 8192) if n < cache.max_len}
                                  | {cache.max_len})
        self.device = cache.device
        self.arange = torch.arange(cache.max_len, device=self.device)
        self.zeros = torch.zeros(max(self.batch_buckets), dtype=torch.long, device=self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def _forward(self, inputs: torch.Tensor, tables: torch.Tensor, B: int, L: int) -> torch.Tensor:
        ids, pos, previous = inputs[0].view(B, 1), inputs[1].view(B, 1), inputs[2]
        slots = [inputs[3 + g].view(B, 1) for g in range(tables.shape[0])]
        mask = (self.arange[:L][None, None, :] <= pos[:, :, None])[:, None]      # (B, 1, 1, L)
        # sliding-window masks are made from `pos` inside the pass, so the graph records them too
        return self.model(ids, CacheBatch(self.cache, list(tables), slots, pos, mask, L, previous),
                          last=self.zeros[:B])

    def _record(self, B: int, L: int) -> _Graph:
        G = len(self.cache.groups)
        inputs = torch.zeros(3 + G, B, dtype=torch.long, device=self.device)   # warm-up and capture: scratch
        tables = torch.zeros(G, B, -(-L // self.cache.block_size), dtype=torch.long, device=self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(inputs, tables, B, L)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(inputs, tables, B, L)
        return _Graph(graph, inputs, tables, out)

    def run(self, tokens: list[int], tables: list[list[list[int]]], positions: list[int],
            previous: list[int] | None = None) -> torch.Tensor:
        """Logits (n, vocab) of one decode pass; valid until the next call. tables: each entry's block tables, one
        per layer group; previous: each entry's token before its pending one (CacheBatch.previous), for a model
        that reads it."""
        n = len(tokens)
        key = (_ceil(self.batch_buckets, n), _ceil(self.len_buckets, max(positions) + 1))
        g = self.graphs.get(key)
        if g is None:
            try:
                g = self.graphs[key] = self._record(*key)
            except Exception as e:
                raise GraphCaptureError(f"recording the decode graph for {key} failed: {e!r}") from e
        pad, bs, width = key[0] - n, self.cache.block_size, g.tables.shape[2]
        groups = range(g.tables.shape[0])
        slots = [[ts[k][p // bs] * bs + p % bs for ts, p in zip(tables, positions)] + [0] * pad for k in groups]
        g.inputs.copy_(torch.tensor([tokens + [0] * pad, positions + [0] * pad, (previous or [-1] * n) + [-1] * pad]
                                    + slots))
        g.tables.copy_(torch.stack([padded_tables([ts[k] for ts in tables] + [[]] * pad, width) for k in groups]))
        g.graph.replay()
        return g.out[:n]
