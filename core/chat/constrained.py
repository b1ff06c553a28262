"""Constrained decoding, the engine's half: a grammar (grammars.py) compiled for this tokenizer, one matcher per
constrained sample, and the masks of allowed tokens computed off the critical path.

A step samples every row, then hands the constrained rows' new tokens to a worker thread (`advance`), which
feeds each row's matcher its token and computes the row's mask of allowed next tokens (llguidance, in native
code that releases the GIL) while the main thread turns the step's tokens into events and runs the next
forward pass. The next sampling waits for the masks (`masks`) and sets the disallowed tokens' logits to -inf, in
the constrained rows only: a free row pays nothing, and a step without constrained rows runs no code here.

A mask is a bit per token (llguidance's layout, 32 tokens an int32): the worker writes the bits of each row; the
critical path gathers the rows' bits (4 KB a row at 32k tokens), moves them to the logits' device, expands them
with one gather from a table of the 256 byte patterns (each byte's 8 values, 0 or -inf) and adds the result to
the logits (an add is an order of magnitude cheaper than a masked fill with a bool mask, and cheaper than
float rows made on the worker and copied; bench/README.md). A matcher that has
completed its grammar allows only the end of the turn; one in error (it never should: every token it is fed came
through its own mask) allows only the end of the turn too, so a broken row ends instead of sampling from nothing.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.tiktoken
import numpy as np
import torch

from .protocol import SamplingError
from .tokenizer import ChatTokenizer

logger = logging.getLogger(__name__)


class TokenMasks:
    """Each constrained row's matcher and its mask of allowed next tokens (the engine's side of grammars.py's
    grammars): compiled here, advanced on a worker thread, applied to the logits before sampling."""

    def __init__(self, tokenizer: ChatTokenizer, vocab_size: int, stop_tokens, rows: int, device: torch.device,
                 threads: int | None = None):
        self.tok, self.vocab_size, self.device = tokenizer, vocab_size, device
        self.stop_tokens = sorted(stop_tokens)
        self.words = (vocab_size + 31) // 32
        self.rows = rows
        self._bits: np.ndarray | None = None       # (rows, words) int32, at the first use
        self._index = self._values = None           # masks' byte indices and expanded values, at the first use
        ends = np.zeros(self.words * 32, dtype=np.uint8)
        ends[self.stop_tokens] = 1
        self._ends = np.packbits(ends, bitorder="little").view(np.int32)   # a mask allowing only the stop tokens
        # a mask byte (8 tokens, lowest bit first) -> its 8 values to add
        self._byte_values = torch.tensor([[0.0 if (b >> k) & 1 else float("-inf") for k in range(8)]
                                          for b in range(256)], device=device)
        self._lltok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._threads = threads or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._executor: llguidance.LLExecutor | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    # ---- compiling (any thread)
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's index of this vocabulary, built once (up to a second for a 50k vocabulary); the engine
        process builds it at start."""
        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance.tiktoken.lltokenizer_from_encoding(
                    self.tok.enc, n_vocab=self.vocab_size, eos_token=self.stop_tokens)
            return self._lltok

    def matchers(self, grammar: str, n: int) -> list[llguidance.LLMatcher]:
        """`n` matchers of `grammar`, at its start; SamplingError if it does not compile."""
        try:
            m = llguidance.LLMatcher(self.tokenizer(), grammar)
        except (ValueError, TypeError, RuntimeError) as e:      # not a grammar at all
            raise SamplingError(f"the structured output is not a grammar: {e}", "response_format") from None
        if m.is_error():
            raise SamplingError(f"the structured output cannot be enforced: {m.get_error().splitlines()[0]}",
                                "response_format")
        return [m] + [m.deep_copy() for _ in range(n - 1)]

    # ---- masks (the stepping thread submits and waits; the worker computes)
    def advance(self, items: list[tuple[llguidance.LLMatcher, int, list[int]]]) -> None:
        """For each (matcher, cache row, tokens): feed the matcher the tokens (none at a grammar's start), then
        compute the row's next mask. Runs on the worker; `masks` waits for it."""
        if not items:
            return
        if self._worker is None:
            self._bits = np.zeros((self.rows, self.words), dtype=np.int32)
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            self._executor = llguidance.LLExecutor(self._threads)
        self._pending.append(self._worker.submit(self._advance, items))

    def _advance(self, items) -> None:
        for m, row, tokens in items:
            if tokens and not m.consume_tokens(tokens):
                logger.warning("a constrained row took a token its grammar refuses: %s", m.get_error()[:200])
        self._executor.unsafe_compute_mask_ptr([(m, row) for m, row, _ in items], self._bits.ctypes.data,
                                               self.words * 4, len(self._bits))
        for m, row, _ in items:
            if m.is_error() or not self._bits[row].any():
                self._bits[row] = self._ends

    def masks(self, rows: list[int]) -> torch.Tensor:
        """(len(rows), vocab) float32, 0 where a token is allowed and -inf where not: the masks of these rows' next
        tokens (waits for the worker)."""
        for f in self._pending:
            f.result()
        self._pending.clear()
        k, n = len(rows), len(rows) * self.words * 4           # rows, mask bytes
        if self._index is None:       # buffers kept across steps: a fresh 6 MB tensor a step costs page faults
            self._index = torch.empty(self.rows * self.words * 4, dtype=torch.long, device=self.device)
            self._values = torch.empty(self.rows * self.words * 4, 8, device=self.device)
        bits = torch.from_numpy(self._bits[rows]).to(self.device, non_blocking=True)
        index = self._index[:n]
        index.copy_(bits.view(torch.uint8).flatten())
        values = torch.index_select(self._byte_values, 0, index, out=self._values[:n])
        return values.view(k, -1)[:, :self.vocab_size]

    def apply(self, logits: torch.Tensor, batch_idx: list[int], rows: list[int]) -> None:
        """Disallowed tokens of the rows `batch_idx` of `logits` (cache rows `rows`) to -inf, in place."""
        add = self.masks(rows)
        if len(batch_idx) == logits.shape[0]:
            logits.add_(add)
        else:
            b = torch.tensor(batch_idx, device=logits.device)
            logits[b] += add
