"""CUDA graphs for whole decision prompts: `decide` on a GPU replays a recorded pass instead of launching it.

One graph per padded length for a single prompt (128 ... 4096), one per (prompts, length) for 2-4 prompts of up
to 1024 tokens. Rows are right-padded without a mask: every layer is causal, so padding never reaches the
position that is read (the last real token of each row). All graphs share one memory pool, recorded largest
first.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)

GRAPH_LENGTHS = (128, 192, 256, 320, 384, 512, 640, 768, 1024, 1536, 2048, 3072, 4096)
GRAPH_ROWS = (1, 2, 3, 4)
MULTI_ROW_MAX_LENGTH = 1024


def graph_shapes() -> list[tuple[int, int]]:
    """Every (rows, length) a graph is recorded for, largest first (they share one memory pool)."""
    shapes = [(b, n) for b in GRAPH_ROWS for n in GRAPH_LENGTHS if b == 1 or n <= MULTI_ROW_MAX_LENGTH]
    return sorted(shapes, key=lambda s: (-s[0] * s[1], -s[1]))


def pick_graph(lengths: list[int], shapes) -> tuple[int, int] | None:
    """The recorded (rows, length) that replays these prompts, or None when none fits."""
    if not lengths:
        return None
    longest = max(lengths)
    fits = [n for b, n in shapes if b == len(lengths) and n >= longest]
    return (len(lengths), min(fits)) if fits else None


def fill_static(ids: torch.Tensor, last: torch.Tensor, prompts: list[list[int]], pad: int) -> None:
    """Write prompts into a graph's static buffers: right-padded ids (rows, n) and each row's last position."""
    host = torch.full(ids.shape, pad, dtype=torch.long)
    for j, p in enumerate(prompts):
        host[j, :len(p)] = torch.tensor(p)
    ids.copy_(host)
    last.copy_(torch.tensor([len(p) - 1 for p in prompts]))


class PromptGraphs:
    """Recorded passes of `slot_logits(ids, last) -> (rows, 26)` for every shape of `graph_shapes()`."""

    def __init__(self, slot_logits: Callable, device: torch.device, pad: int):
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pad = pad
        self._record(slot_logits, device)

    @torch.inference_mode()
    def _record(self, slot_logits, device) -> None:
        pool = None
        for b, n in graph_shapes():
            ids = torch.full((b, n), self.pad, dtype=torch.long, device=device)
            last = torch.full((b,), n - 1, dtype=torch.long, device=device)
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(3):   # autotune and warm every kernel outside the capture
                    slot_logits(ids, last)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = slot_logits(ids, last)
            pool = graph.pool()
            self.graphs[(b, n)] = (graph, ids, last, out)
        logger.info("recorded %d CUDA graphs", len(self.graphs))

    def shape_for(self, prompts: list[list[int]]) -> tuple[int, int] | None:
        return pick_graph([len(p) for p in prompts], self.graphs)

    @torch.inference_mode()
    def replay(self, shape, prompts: list[list[int]]) -> list[torch.Tensor]:
        """In inference mode, as the static buffers were made: torch refuses to write an inference tensor
        outside it."""
        graph, static_ids, last, out = self.graphs[shape]
        fill_static(static_ids, last, prompts, self.pad)
        graph.replay()
        res = out.cpu()
        return [res[j].clone() for j in range(len(prompts))]
