"""The chat engine: continuous batching over a KV cache of shared blocks.

Design (after vLLM's v1 engine, at nanochat's scale). A request is a prompt and `SamplingParams`; each of its
`n` samples holds a row (its per-sequence state) and a block table into the KV cache (kv_cache.py). `step()` is
one round of three parts:
- schedule (scheduler.py, no torch): take in new requests and aborts, give waiting requests rows and blocks
  (sharing the cached blocks of their prompt's longest cached prefix, block_pool.py), pick the prompt tokens to
  prefill and the samples to decode, a block for each sample that fills one (preempting when none is
  left);
- run (here): one prefill pass over up to `prefill_chunk` prompt tokens, then one decode pass for every
  running sample (CUDA graphs on a GPU, eager otherwise), each followed by the sampler;
- outputs (outputs.py, no model): each token through the calculator state machine, the text decoder and the
  stop strings, into `TokenEvent`s.
A caller that streams can have the events ready before the decode pass (the first tokens of new prompts)
handed over at once (`step(emit=...)`).

`n` samples of a prompt share one prefill: the siblings share its full blocks (the partly filled last one is
copied) and each sample draws its own first token. A request may continue an earlier generation of the same
prompt (`resume`: the tokens that generation had delivered, e.g. on a replica that was lost): those tokens are
prefilled after the prompt and replayed through the output side (their events dropped) and the penalties, and
the sample's random stream advances one draw per token as it did in the first run, so the continuation is the
rest of that run.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging

import msgspec
import torch

from . import decode_stack
from .attention import path as attention_path
from .constrained import TokenMasks
from .cuda_graphs import DecodeGraphs, GraphCaptureError
from .block_pool import chain
from .kv_cache import CacheBatch, KVCache, LayerGroups
from .logits import LogitProcessor, LogprobResult, logprobs
from .model import ChatNetwork
from .outputs import OutputProcessor
from .packed import PackedLinear, pack_linears
from .quantized import quantize_linears
from .protocol import KV_CPU_BYTES, KV_CUDA_SHARE, EngineConfig, EngineStats, SamplingParams, TokenEvent
from .sampler import sample
from .scheduler import Request, Sample, Scheduler, new_request
from .tokenizer import ChatTokenizer

logger = logging.getLogger(__name__)

_ids = itertools.count()
PAD_LIMIT = 1.25      # a prefill pass computes at most this many positions per prompt token it feeds


def pad_groups(batch: list[tuple[Request, Sample, int]]) -> list[list[tuple[Request, Sample, int]]]:
    """(request, sample, tokens) chunks -> passes, longest first, each padding its chunks to its first's length
    and computing at most PAD_LIMIT positions per real token (a chunk that alone would break that starts the next
    pass)."""
    groups: list[list[tuple[Request, Sample, int]]] = []
    real = 0
    for item in sorted(batch, key=lambda rt: -rt[2]):
        if groups and (len(groups[-1]) + 1) * groups[-1][0][2] <= PAD_LIMIT * (real + item[2]):
            groups[-1].append(item)
            real += item[2]
        else:
            groups.append([item])
            real = item[2]
    return groups


class LLMEngine:
    def __init__(self, model: ChatNetwork, tokenizer: ChatTokenizer, config: EngineConfig | None = None,
                 prefix_ids: list[int] | None = None, **settings):
        """config: the engine's settings (EngineConfig); keyword `settings` override single fields of it
        (`LLMEngine(model, tok, max_rows=4)`). The KV cache is a pool of blocks of `kv_cache_memory` bytes
        (cache_blocks); on a CUDA device with cuda_graphs, decode passes replay recorded graphs (cuda_graphs.py).
        `prefix_ids` (the few-shot prefix) is computed once into blocks that stay cached for good."""
        config = dataclasses.replace(config or EngineConfig(), **settings)
        self.config = config
        self.model, self.tok = model.eval(), tokenizer
        cfg = model.config
        self.sequence_len, self.vocab_size = cfg.sequence_len, cfg.vocab_size
        self.max_rows = config.max_rows
        self.device = model.get_device()
        if config.weights == "int8":      # (a model quantized before has no nn.Linear left: nothing to do)
            quantize_linears(model, config.small_row_kernel)
            self.linear = "int8"
        elif self.device.type == "cpu" and config.packed_linear:
            self.linear = self._pack(model, config.small_row_kernel)
        else:
            self.linear = "torch"
        self.attention = attention_path(self.device)     # builds the CPU kernel now, not at the first request
        # decode reads a prefix that sequences share once for them all (the CPU kernel's cascade)
        self.shared_prefixes = config.shared_prefix_attention and self.attention == "cpu-kernel"
        self.attention_threads = (config.attention_threads or 0) if self.device.type == "cpu" else 0
        dtype = next(model.parameters()).dtype
        self.dtype = str(dtype).removeprefix("torch.")
        n_blocks = cache_blocks(cfg, config, dtype, self.device)
        self.cache = KVCache.for_model(cfg, n_blocks, config.block_size, dtype=dtype, device=self.device)
        self.scheduler = Scheduler(config, n_blocks, config.block_size, self.cache.groups.windows)
        # decode steps of a few rows run the model's blocks in one call (decode_stack.py; built now)
        self.decode_stack = None
        if (config.fused_decode and config.small_row_kernel and self.device.type == "cpu"
                and self.attention == "cpu-kernel"):
            self.decode_stack = decode_stack.prepare(model, self.cache)
        self.fused_decode = self.decode_stack is not None      # (benchmarks switch it off to compare)
        self.graphs = None
        if config.cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(model, self.cache, max_batch=config.max_rows)
        self.outputs = OutputProcessor(tokenizer, cfg.sequence_len)
        self.logits = LogitProcessor(config.max_rows, cfg.vocab_size, self.device)
        self.grammars = TokenMasks(tokenizer, cfg.vocab_size, self.outputs.stop_tokens, config.max_rows, self.device)
        self._observed: tuple[list[int], list[int]] = ([], [])   # (row, token) appended to processed rows
        self.prefix_ids: list[int] = []
        self._prefix_tables: list[list[int]] = []
        if prefix_ids:
            self.set_prefix(prefix_ids)

    @staticmethod
    def _pack(model: ChatNetwork, small_rows: bool = True) -> str:
        """The model's large linear layers through oneDNN with packed weights (packed.py), in place; ->
        "onednn-packed"; "torch" where no layer is large enough to gain; "torch-fallback" where packing failed
        (then one warning, and the replica's chat_linear_fallback gauge reads 1: the model runs as built)."""
        try:
            pack_linears(model, small_rows=small_rows)
        except Exception as e:      # noqa: BLE001 - any failure leaves torch's own path, which always works
            logger.warning("the chat model's linear layers stay on torch's F.linear, slower at decode batch "
                           "sizes: packing them for oneDNN failed (%s: %s)", type(e).__name__, e)
            return "torch-fallback"
        # (an engine built on a model another engine packed finds its layers packed already)
        return "onednn-packed" if any(isinstance(m, PackedLinear) for m in model.modules()) else "torch"

    @property
    def decode(self) -> str:
        """How a decode pass of a few rows runs the model's blocks: "stack" (decode_stack.py's one call) or
        "modules"."""
        return "stack" if self.fused_decode and self.decode_stack is not None else "modules"

    # ---- requests in and out (safe to call from another thread than step())
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    resume: list[int] | None = None) -> str:
        """Queue a request; -> its id. resume: the tokens an earlier run of this prompt and these parameters had
        generated; the request continues that run (events for the new tokens only; token counts include them)."""
        req = new_request(request_id or f"req-{next(_ids)}", prompt, params, resume, self.sequence_len,
                          self.vocab_size, self.max_rows, self.outputs)
        if params.grammar is not None:
            for s, m in zip(req.samples, self.grammars.matchers(params.grammar, params.n)):
                s.matcher = m
        self.scheduler.add(req)
        return req.id

    def abort(self, request_id: str) -> None:
        """Stop a request; its rows are freed at the next step."""
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    # ---- the few-shot prefix
    @torch.inference_mode()
    def set_prefix(self, prefix_ids: list[int]) -> None:
        """Compute `prefix_ids` once into blocks that the engine holds for good: prompts that start with them share
        their full blocks (the prefix cache's ordinary hit)."""
        pool = self.scheduler.pool
        for table in self._prefix_tables:
            pool.release(table)
        G, n = len(self.cache.groups), pool.blocks_for(len(prefix_ids))
        blocks = pool.allocate(G * n)
        if blocks is None:
            raise ValueError(f"the few-shot prefix ({len(prefix_ids)} tokens) does not fit the KV cache")
        tables = [blocks[g * n:(g + 1) * n] for g in range(G)]
        self.cache.touch(pool.touched)
        ids = torch.tensor([prefix_ids], device=self.device)
        self.model(ids, CacheBatch.build(self.cache, [tables], [0], len(prefix_ids)),
                   last=torch.tensor([0], device=self.device))
        if self.config.prefix_caching:
            digests = chain(list(prefix_ids), pool.block_size, [])
            for g, table in enumerate(tables):
                pool.commit(g, table, digests, 0, len(digests))
        self.prefix_ids, self._prefix_tables = list(prefix_ids), tables

    # ---- one round: schedule, run, outputs
    @torch.inference_mode()
    def step(self, emit=None) -> list[TokenEvent]:
        """One scheduling round; returns its events. With `emit`, the events ready before the decode pass (the
        first tokens of prompts that finished prefilling, aborts) go to `emit(events)` at once instead, so a new
        request's first token does not wait for every running row's next token."""
        sched = self.scheduler
        events: list[TokenEvent] = []
        for req in sched.collect():
            events += [self.outputs.finish(req, s.output, "abort") for s in req.samples if not s.finished]
        self._admit(events)
        decoding = sched.decoding()
        if sched.prefilling:
            self._prefill(sched.prefill_batch(), events)
        if emit is not None and events and decoding:
            emit(events)
            events = []
        if decoding:
            decoding = sched.grow(decoding)
            self.cache.touch(sched.pool.touched)
        if decoding:
            self._decode(decoding, events)
        sched.retire()
        return events

    def _admit(self, events: list[TokenEvent]) -> None:
        admitted = self.scheduler.admit()
        self.cache.touch(self.scheduler.pool.touched)       # the blocks admission handed out hold finite values
        for adm in admitted:
            req = adm.request
            if adm.copy:
                for src, dst in adm.copy:
                    self.cache.copy_block(src, [dst])
                self.scheduler.pool.release([src for src, _ in adm.copy])
            if req.started:                            # preempted earlier: its keys are computed again
                self.scheduler.start_prefill(req)
                continue
            if req.params.processes_logits:
                for s in req.samples:
                    self.logits.start(s.row, req.params, req.prompt)
            if req.resume and not self._replay(req, req.samples[0], events):
                self.scheduler.start_running(req)      # it ended inside the replay: retire frees its row
                continue
            if req.params.grammar is not None:         # the first masks, computed while the prompt prefills
                self.grammars.advance([(s.matcher, s.row, list(req.resume)) for s in req.samples])
            self.scheduler.start_prefill(req)

    def _replay(self, req: Request, s: Sample, events: list[TokenEvent]) -> bool:
        """Bring sample `s` to where the run it continues stopped: the resumed tokens go through the output side
        (their events dropped: they were delivered before) and the penalties, and each takes one draw of the
        sample's random stream, as a step does for every row, forced or not. -> whether the sample still runs (a
        stop string hit by the replay ends it, with its finish event)."""
        for _ in req.resume:
            s.rng.random()
        finish = self.outputs.replay(req, s.output, req.resume)
        if finish is not None:
            events.append(finish)
            return False
        s.pending = req.resume[-1]
        if req.params.processes_logits:          # penalties count the resumed tokens before the first new one
            self.logits.observe([s.row] * len(req.resume), list(req.resume))
        return True

    def _prefill(self, batch: list[tuple[Request, Sample, int]], events: list[TokenEvent]) -> None:
        """The step's prompt chunks, in passes of chunks of similar length (`pad_groups`): a pass pads every
        chunk to its longest, and one pass for 32 prompts of 16-96 tokens computed 1.6 positions per token."""
        for group in pad_groups(batch):
            self._prefill_pass(group, events)

    def _prefill_pass(self, batch: list[tuple[Request, Sample, int]], events: list[TokenEvent]) -> None:
        T = max(take for _, _, take in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        tokens = [req.tokens(s) for req, s, _ in batch]
        for j, (req, s, take) in enumerate(batch):
            ids[j, :take] = torch.tensor(tokens[j][s.position:s.position + take])
        start = [s.position for _, s, _ in batch]
        previous = ([t[p - 1] if p else -1 for t, p in zip(tokens, start)] if self.model.needs_previous else None)
        # right padding: a padded position is written to the scratch block and never read
        cb = CacheBatch.build(self.cache, [s.tables for _, s, _ in batch], start, T, previous,
                              threads=self.attention_threads, lengths=[take for _, _, take in batch])
        last = torch.tensor([take - 1 for _, _, take in batch], device=self.device)
        if any(req.prompt_entries is not None for req, _, _ in batch):
            hidden = self.model.hidden(ids.to(self.device), cb)
            for j, (req, s, take) in enumerate(batch):
                if req.prompt_entries is not None:
                    self._score_prompt(req, s.position, hidden[j, :take])
            logits = self.model.logits(hidden[torch.arange(len(batch), device=self.device), last])
        else:
            logits = self.model(ids.to(self.device), cb, last=last)
        finished = []
        for j, (req, s, take) in enumerate(batch):
            s.position += take
            self.scheduler.filled(req, s)
            if all(x.position >= x.target or x.finished for x in req.samples):
                finished.append((j, req))
        if not finished:
            return
        # each sample of a finished prompt draws its own first token from the prompt's last logits; a preempted
        # request's samples go on from their pending tokens
        rows_logits, targets = [], []
        for j, req in finished:
            started = req.started
            for src, dst in self.scheduler.prefilled(req):
                self.cache.copy_block(src, [dst])
            if started:
                continue
            fed = len(req.feed)
            scored = self.scheduler.scored(req) if req.prompt_entries is not None else None
            if req.max_new == 0:                    # the prompt is scored; nothing is generated
                for s in req.samples:
                    finish = self.outputs.finish(req, s.output, "length")
                    if s is req.samples[0] and scored is not None:
                        finish = msgspec.structs.replace(finish, prompt_logprobs=scored)
                    events.append(finish)
                continue
            req.scored = scored
            for s in req.samples:
                assert s.position == fed
                rows_logits.append(j)
                targets.append((req, s))
        if targets:
            self._sample_and_accept(logits[torch.tensor(rows_logits, device=self.device)], targets, events)

    def _score_prompt(self, req: Request, start: int, hidden: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens this prefill chunk (from position `start`) predicts (the
        model's own: before bias, penalties and temperature), with the most probable tokens at each place, added
        to req.prompt_entries."""
        n = min(len(hidden), len(req.prompt) - 1 - start)     # positions whose next token is a prompt token
        if n <= 0:
            return
        lp = torch.log_softmax(self.model.logits(hidden[:n]).float(), dim=-1)
        targets = torch.tensor(req.prompt[start + 1:start + 1 + n], device=lp.device)
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
        k = req.params.prompt_logprobs
        if k:
            vals, idx = lp.topk(k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        else:
            tops = [[] for _ in range(n)]
        req.prompt_entries += [(t, c, top) for t, c, top in zip(req.prompt[start + 1:start + 1 + n], chosen, tops)]

    def _decode(self, decoding: list[tuple[Request, Sample]], events: list[TokenEvent]) -> None:
        tables, positions = [s.tables for _, s in decoding], [s.position for _, s in decoding]
        previous = [req.token_at(s, s.position - 1) for req, s in decoding] if self.model.needs_previous else None
        logits = None
        if self.graphs is not None:
            try:
                logits = self.graphs.run([s.pending for _, s in decoding], tables, positions, previous)
            except GraphCaptureError:
                logger.exception("CUDA graphs for decode are off from now on; decoding eagerly")
                self.graphs = None
        if logits is None:
            ids = torch.tensor([[s.pending] for _, s in decoding], device=self.device)
            cb = CacheBatch.build(self.cache, tables, positions, 1, previous, self.shared_prefixes,
                                  self.attention_threads, fused=self.decode_stack if self.fused_decode else None)
            logits = self.model(ids, cb, last=torch.zeros(len(decoding), dtype=torch.long, device=self.device))
        bs, windowed = self.cache.block_size, self.scheduler.windowed
        for req, s in decoding:
            s.position += 1
            if windowed or s.position % bs == 0:
                self.scheduler.filled(req, s)
        self._sample_and_accept(logits, decoding, events)

    # ---- sampling, then each token to the output side
    def _sample_and_accept(self, logits: torch.Tensor, targets: list[tuple[Request, Sample]],
                           events: list[TokenEvent]) -> None:
        """A token for every target row: the calculator's next forced token where one is queued, else the sampled
        one; then the output side's events, and the penalties' counts."""
        tokens, lps = self._sample(logits, targets)
        for (req, s), tok, lp in zip(targets, tokens, lps):
            out = s.output
            forced = bool(out.forced)
            tok = out.forced.popleft() if forced else tok
            s.pending = tok
            if req.params.processes_logits:
                self._observed[0].append(s.row)
                self._observed[1].append(tok)
            scored = None
            if req.scored is not None and s is req.samples[0]:
                scored, req.scored = req.scored, None
            events += self.outputs.accept(req, out, tok, forced, s.position, None if forced else lp, scored)
        rows, toks = self._observed
        if rows:
            self.logits.observe(rows, toks)
            self._observed = ([], [])
        # the constrained rows' next masks, computed while this step's events are made and the next pass runs
        self.grammars.advance([(s.matcher, s.row, [s.pending]) for _, s in targets
                               if s.matcher is not None and not s.finished])

    def _sample(self, logits: torch.Tensor,
                targets: list[tuple[Request, Sample]]) -> tuple[list[int], list[LogprobResult | None]]:
        """Sample one token per target row; the rows whose requests ask for it get their logits processed first
        (bias, penalties) and their log-probabilities computed (not for a row whose next token the calculator
        forces: it is not sampled); constrained rows sample from the tokens their grammar allows (their
        log-probabilities are the model's before that mask, as they are before temperature and top-k)."""
        ps = [r.params for r, _ in targets]
        processed = [i for i, p in enumerate(ps) if p.processes_logits]
        if processed:
            logits = self.logits.apply(logits.float(), processed, [targets[i][1].row for i in processed],
                                       [ps[i] for i in processed])
        asked = [i for i, p in enumerate(ps) if p.logprobs is not None and not targets[i][1].output.forced]
        scored = logits
        constrained = [i for i, (_, s) in enumerate(targets) if s.matcher is not None and not s.output.forced]
        if constrained:
            if asked:
                scored = logits.clone()
            self.grammars.apply(logits, constrained, [targets[i][1].row for i in constrained])
        tokens = sample(logits, [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                        [s.rng.random() for _, s in targets]).tolist()
        lps: list[LogprobResult | None] = [None] * len(targets)
        if asked:
            for i, res in zip(asked, logprobs(scored, asked, [tokens[i] for i in asked],
                                              [ps[i].logprobs for i in asked])):
                lps[i] = res
        return tokens, lps

    def fail_all(self, reason: str = "error") -> list[TokenEvent]:
        """End every request (after a fault in the model); the engine stays usable."""
        events = [self.outputs.fail(req, s.output, reason) for req, s in self.scheduler.unfinished()]
        self.scheduler.retire()
        return events


def cache_blocks(model_config, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """How many blocks the KV cache has: `kv_cache_memory` bytes (default: KV_CUDA_SHARE of the memory free on a
    CUDA device after the weights, KV_CPU_BYTES on a CPU) over one block's bytes; at least enough for one
    sequence of the model's whole context, or a ValueError says what to raise."""
    per_block = KVCache.block_bytes(model_config, config.block_size, dtype)
    groups = len(LayerGroups.of(model_config.layer_windows))
    memory = config.kv_cache_memory
    if memory is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            memory = int(free * KV_CUDA_SHARE)
        else:
            memory = KV_CPU_BYTES
    n_blocks = memory // per_block
    need = 1 + groups * -(-model_config.sequence_len // config.block_size)
    if n_blocks < need:
        raise ValueError(f"chat_kv_cache_memory of {memory} bytes holds {n_blocks} blocks of {per_block} bytes; one "
                         f"sequence of the model's {model_config.sequence_len} positions needs {need} "
                         f"({need * per_block} bytes)")
    return n_blocks

