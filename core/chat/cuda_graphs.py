"""CUDA graphs for the engine's decode pass.

A decode step of a small model is a few hundred kernel launches that keep the GPU busy for a fraction of
the step (bench/README.md has the H200 profile); replaying a
recorded graph launches them all at once. Shapes must be static, so a graph is recorded per (batch bucket,
key-length bucket) on first use: the batch is padded with a scratch cache row that no request owns (its
writes land there), and attention reads the bucket's keys under the usual mask, so padding never reaches a
real row's result. The cache is allocated at full length up front, since a graph holds its addresses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import CacheBatch, KVCache


class GraphCaptureError(RuntimeError):
    """Recording a graph failed; the caller runs the pass eagerly instead."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor      # (4, B) on the device: token ids, cache rows, positions, previous tokens
    out: torch.Tensor         # (B, vocab) logits


def _ceil(buckets: list[int], n: int) -> int:
    return next(b for b in buckets if b >= n)


class DecodeGraphs:
    def __init__(self, model, cache: KVCache, scratch_row: int, max_batch: int):
        if cache.capacity != cache.max_len:
            raise ValueError("CUDA graphs need the KV cache allocated at full length")
        self.model, self.cache, self.scratch_row = model, cache, scratch_row
        self.batch_buckets = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch} | {max_batch})
        self.len_buckets = sorted({n for n in (128, 256, 512, 1024, 2048, 4096, 8192) if n < cache.max_len}
                                  | {cache.max_len})
        self.device = cache.device
        self.arange = torch.arange(cache.max_len, device=self.device)
        self.zeros = torch.zeros(max(self.batch_buckets), dtype=torch.long, device=self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def _forward(self, inputs: torch.Tensor, B: int, L: int) -> torch.Tensor:
        ids, rows, pos, previous = inputs[0].view(B, 1), inputs[1], inputs[2].view(B, 1), inputs[3]
        mask = (self.arange[:L][None, None, :] <= pos[:, :, None])[:, None]      # (B, 1, 1, L)
        # sliding-window masks are made from `pos` inside the pass, so the graph records them too
        return self.model(ids, CacheBatch(self.cache, rows, None, pos, mask, L, previous), last=self.zeros[:B])

    def _record(self, B: int, L: int) -> _Graph:
        inputs = torch.zeros(4, B, dtype=torch.long, device=self.device)
        inputs[1] = self.scratch_row               # warm-up and capture write to the scratch row only
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(inputs, B, L)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(inputs, B, L)
        return _Graph(graph, inputs, out)

    def run(self, tokens: list[int], rows: list[int], positions: list[int],
            previous: list[int] | None = None) -> torch.Tensor:
        """Logits (n, vocab) of one decode pass; valid until the next call. previous: each row's token before its
        pending one (CacheBatch.previous), for a model that reads it."""
        n = len(tokens)
        key = (_ceil(self.batch_buckets, n), _ceil(self.len_buckets, max(positions) + 1))
        g = self.graphs.get(key)
        if g is None:
            try:
                g = self.graphs[key] = self._record(*key)
            except Exception as e:
                raise GraphCaptureError(f"recording the decode graph for {key} failed: {e!r}") from e
        pad = key[0] - n
        g.inputs.copy_(torch.tensor([tokens + [0] * pad, rows + [self.scratch_row] * pad, positions + [0] * pad,
                                     (previous or [-1] * n) + [-1] * pad]))
        g.graph.replay()
        return g.out[:n]
