"""CUDA graphs for the decision model's passes: a GPU replays a recorded pass instead of launching its kernels
one by one (a small pass is bound by the host's launches, not by the device).

- `PromptGraphs`, whole prompts (`decide`, one request): one graph per padded length for a single prompt (128
  ... 4096), one per (prompts, length) for 2-4 prompts of up to 1024 tokens. Rows are right-padded without a
  mask: every layer is causal, so padding never reaches the position that is read (the last real token of
  each row).
- `TailGraphs`, question tails continuing from cached prefix states (the state-once passes of a batch): one
  graph per (rows, prefix length, tail length) bucket. The states are copied into static buffers, the
  full-attention keys left-padded to the bucket's prefix length and masked, the tails right-padded; rows past
  the real ones are ignored.

Each kind's graphs share one memory pool, recorded largest first.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

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


# Tail graphs: rows x prefix x tail buckets, within the tokens one pass computes (rows x tail) and the positions
# its cache holds (rows x (prefix + tail)); 114 shapes at these values.
TAIL_ROWS = (1, 2, 4, 8, 16, 32, 64)
TAIL_PREFIXES = (256, 512, 1024, 2048, 4096)
TAIL_LENGTHS = (32, 64, 128, 256)
TAIL_MAX_TOKENS = 8192
TAIL_MAX_HELD = 65536


def tail_shapes(rows=TAIL_ROWS, prefixes=TAIL_PREFIXES, tails=TAIL_LENGTHS, max_tokens: int = TAIL_MAX_TOKENS,
                max_held: int = TAIL_MAX_HELD) -> list[tuple[int, int, int]]:
    """Every (rows, prefix, tail) a tail graph is recorded for, largest first (they share one memory pool). The
    set is closed downwards: a shape's smaller neighbours are in it too."""
    shapes = [(r, p, t) for r in rows for p in prefixes for t in tails
              if r * t <= max_tokens and r * (p + t) <= max_held]
    return sorted(shapes, key=lambda s: (-s[0] * s[2], -s[0] * (s[1] + s[2]), s))


def pick_tail(rows: int, prefix: int, tail: int, shapes) -> tuple[int, int, int] | None:
    """The smallest recorded (rows, prefix, tail) bucket that holds a pass of `rows` tails of at most `tail`
    tokens on prefixes of at most `prefix` tokens, or None."""
    def least(values, n):
        return min((v for v in values if v >= n), default=None)

    r = least({s[0] for s in shapes}, rows)
    p = least({s[1] for s in shapes}, max(prefix, 1))
    t = least({s[2] for s in shapes}, tail)
    if r is None or p is None or t is None or (r, p, t) not in shapes:
        return None
    return r, p, t


@dataclass
class TailBuffers:
    """One bucket's static inputs: right-padded tail ids (rows, tail), each row's prefix length and last tail
    position (rows,), and per layer the prefix states (views of buffers all buckets share)."""

    ids: torch.Tensor
    lengths: torch.Tensor
    last: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor]]


class TailGraphs:
    """Recorded tail passes: `tail_pass(buffers, prefix) -> (rows, 26)` for every shape of `shapes`.

    `layout` is one prefix state (prefix_cache.PrefixState) of any length: its kinds, shapes and dtypes size
    the buffers. Every bucket's buffers are views of one flat buffer per layer and tensor, sized for the largest
    bucket: one bucket replays at a time (the scorer holds its lock). With `capture=False` nothing is recorded
    and `replay` runs `tail_pass` on the same buffers: the CPU tests' way to check the static formulation
    against the eager pass."""

    def __init__(self, tail_pass: Callable, layout, device: torch.device, pad: int,
                 shapes: Sequence[tuple[int, int, int]] | None = None, capture: bool = True):
        from .prefix_cache import FULL

        self.tail_pass, self.pad, self.device = tail_pass, pad, torch.device(device)
        self.shapes = list(shapes if shapes is not None else tail_shapes())
        self.kinds = list(layout.kinds)
        most_rows = max(s[0] for s in self.shapes)
        most_held = max(s[0] * s[1] for s in self.shapes)
        self._flat: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._zeros: list[tuple[torch.Tensor, torch.Tensor]] = []      # a fresh row of each linear layer
        for kind, (a, b) in zip(self.kinds, layout.tensors):
            if kind == FULL:           # (1, heads, n, dim): room for most_held positions
                per = a.shape[1] * a.shape[3]
                self._flat.append((a.new_zeros(most_held * per), b.new_zeros(most_held * per)))
                self._zeros.append((None, None))
            else:                      # fixed-size states: room for most_rows rows
                self._flat.append((a.new_zeros(most_rows * a[0].numel()), b.new_zeros(most_rows * b[0].numel())))
                self._zeros.append((torch.zeros_like(a), torch.zeros_like(b)))
        self._row_shapes = [(a.shape[1:], b.shape[1:]) for a, b in layout.tensors]
        self.buffers = {shape: self._buffers(shape) for shape in self.shapes}
        self.graphs: dict[tuple[int, int, int], tuple] = {}
        self.nbytes = sum(t.numel() * t.element_size() for pair in self._flat for t in pair)
        if capture:
            self._record()

    def _buffers(self, shape) -> TailBuffers:
        from .prefix_cache import FULL

        rows, prefix, tail = shape
        layers = []
        for kind, (fa, fb), (sa, sb) in zip(self.kinds, self._flat, self._row_shapes):
            if kind == FULL:
                a_shape = (rows, sa[0], prefix, sa[2])
                b_shape = (rows, sb[0], prefix, sb[2])
            else:
                a_shape, b_shape = (rows, *sa), (rows, *sb)
            layers.append((fa[:math.prod(a_shape)].view(a_shape), fb[:math.prod(b_shape)].view(b_shape)))
        return TailBuffers(torch.full((rows, tail), self.pad, dtype=torch.long, device=self.device),
                           torch.zeros(rows, dtype=torch.long, device=self.device),
                           torch.zeros(rows, dtype=torch.long, device=self.device), layers)

    @torch.inference_mode()
    def _record(self) -> None:
        pool = None
        for shape in self.shapes:
            buffers = self.buffers[shape]
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(3):   # autotune and warm every kernel outside the capture
                    self.tail_pass(buffers, shape[1])
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.tail_pass(buffers, shape[1])
            pool = graph.pool()
            self.graphs[shape] = (graph, out)
        logger.info("recorded %d tail graphs (%.1f MB of state buffers)", len(self.graphs), self.nbytes / 2**20)

    def shape_for(self, states: list, tails: list[list[int]]) -> tuple[int, int, int] | None:
        prefix = max((s.length if s is not None else 0) for s in states)
        return pick_tail(len(tails), prefix, max(len(t) for t in tails), self.buffers)

    def fill(self, shape, states: list, tails: list[list[int]]) -> None:
        """Copy the rows' prefix states and tails into `shape`'s buffers (None or an empty state: a fresh row)."""
        from .prefix_cache import FULL

        buffers, prefix = self.buffers[shape], shape[1]
        n = len(tails)
        lengths = [s.length if s is not None else 0 for s in states]
        fill_static(buffers.ids, buffers.last[:n], tails, self.pad)      # rows past n: all padding
        buffers.lengths[:n].copy_(torch.tensor(lengths))
        buffers.lengths[n:] = 0
        buffers.last[n:] = 0
        for i, (kind, (a, b)) in enumerate(zip(self.kinds, buffers.layers)):
            if kind == FULL:       # left-padded to the bucket: the mask hides positions before each prefix
                for j, (s, length) in enumerate(zip(states, lengths)):
                    if length:
                        a[j, :, prefix - length:].copy_(s.tensors[i][0][0])
                        b[j, :, prefix - length:].copy_(s.tensors[i][1][0])
            else:
                za, zb = self._zeros[i]
                torch.cat([s.tensors[i][0] if length else za for s, length in zip(states, lengths)], out=a[:n])
                torch.cat([s.tensors[i][1] if length else zb for s, length in zip(states, lengths)], out=b[:n])

    @torch.inference_mode()
    def replay(self, shape, states: list, tails: list[list[int]]) -> torch.Tensor:
        """(rows, 26) letter logits of the tails, on the host."""
        self.fill(shape, states, tails)
        if shape in self.graphs:
            graph, out = self.graphs[shape]
            graph.replay()
        else:
            out = self.tail_pass(self.buffers[shape], shape[1])
        return out[:len(tails)].cpu()
