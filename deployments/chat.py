"""The chat deployment: one checkpoint and one continuous-batching engine per replica.

Many streams share the replica's engine (nanochat's old server and seed 001 served one request at a
time under a lock). `generate` is a streaming method: the Ingress calls it through a streaming handle with a
`GenerateRequest` and gets lists of `TokenEvent`s (core/chat/protocol.py). If the caller goes away, the
generator is closed or cancelled and the engine aborts the request, freeing its cache rows at the next step.
By default the engine steps in a child process of the replica (core/chat/engine_process.py), so the model and
the replica's event loop never wait on each other's GIL; `chat_engine_process: false` keeps it on a thread.

A generation here is: prompt ids (the chat template, or raw prompts after <|bos|>), one engine stream per
prompt (merged), the events grouped into messages (`stream_interval`), metrics on the way.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AsyncIterator

import msgspec
from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from core.chat import ChatPrompter, ChatTokenizer, PromptError, load_chat_defaults, load_chat_tokenizer
from core.chat.engine_process import start_engine
from core.chat.protocol import (EngineDied, EngineError, EngineFull, EngineStats, GenerateRequest, SamplingDefaults,
                                SamplingError, ShownLogprobs, ShownToken, Start, StreamError, TokenEvent)

from .settings import ChatSettings, checkpoint_time

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class ChatMetrics:
    def __init__(self, model: str):
        tags = {"model": model}
        self.ttft = Histogram("chat_time_to_first_token_seconds", "Time from arrival to the first token.",
                              LATENCY_BUCKETS, tag_keys=("model",))
        self.itl = Histogram("chat_inter_token_latency_seconds", "Time between two tokens of one stream.",
                             LATENCY_BUCKETS, tag_keys=("model",))
        self.e2e = Histogram("chat_e2e_latency_seconds", "Time from arrival to the last token.", LATENCY_BUCKETS,
                             tag_keys=("model",))
        self.generated = Counter("chat_generated_tokens_total", "Tokens generated.", tag_keys=("model",))
        self.prompted = Counter("chat_prompt_tokens_total", "Prompt tokens.", tag_keys=("model",))
        self.running = Gauge("chat_running_requests", "Requests holding KV-cache rows.", tag_keys=("model",))
        self.waiting = Gauge("chat_waiting_requests", "Requests waiting for free rows.", tag_keys=("model",))
        self.cache = Gauge("chat_kv_cache_usage", "Share of KV-cache positions in use (0-1).", tag_keys=("model",))
        # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens
        self.prefix_queries = Counter("chat_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                                      tag_keys=("model",))
        self.prefix_hits = Counter("chat_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                                   tag_keys=("model",))
        self._reported = (0, 0)
        for m in (self.ttft, self.itl, self.e2e, self.generated, self.prompted, self.running, self.waiting,
                  self.cache, self.prefix_queries, self.prefix_hits):
            m.set_default_tags(dict(tags))   # Serve adds its own tags to the dict it is given

    def engine_stats(self, s: EngineStats) -> None:
        """The engine's counters, as its client reports them (every STATS_PERIOD_S while it is busy)."""
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.cache.set(s.cache_usage)
        queries, hits = self._reported
        if s.prefix_query_tokens > queries:
            self.prefix_queries.inc(s.prefix_query_tokens - queries)
        if s.prefix_hit_tokens > hits:
            self.prefix_hits.inc(s.prefix_hit_tokens - hits)
        self._reported = (max(queries, s.prefix_query_tokens), max(hits, s.prefix_hit_tokens))

    def tokens(self, batch: list[TokenEvent], arrival: float, last: dict[int, float]) -> None:
        """Time to first token, inter-token latency and the token count of one batch of events; `last` keeps
        each sample's latest token time."""
        now, tokens = time.monotonic(), 0
        for ev in batch:
            if ev.token is not None:
                tokens += 1
                if ev.index in last:
                    self.itl.observe(now - last[ev.index])
                else:
                    self.ttft.observe(now - arrival)
                last[ev.index] = now
        if tokens:
            self.generated.inc(tokens)


def refusal(e: Exception) -> StreamError:
    """The error a client sees for a generation the replica could not start (one place for the mapping)."""
    if isinstance(e, EngineFull):
        return StreamError(f"the chat model is at capacity: {e}", "overloaded_error")
    if isinstance(e, EngineDied):
        return StreamError("the chat engine stopped; retry the request", "server_error")
    return StreamError(str(e), param=getattr(e, "param", None))


REFUSED = (PromptError, SamplingError, EngineError, EngineFull, EngineDied)
MODEL_FAILED = StreamError("the model failed while generating", "server_error")
ENGINE_STOPPED = StreamError("the chat engine stopped while generating; retry the request", "server_error")


def shown_token(tok: ChatTokenizer, token_id: int, logprob: float | None) -> ShownToken:
    """A token as OpenAI's logprobs show it: its text, its UTF-8 bytes, its logprob. A special token shows its
    name and has no bytes; a token that is part of a multi-byte character shows U+FFFD and its own bytes."""
    raw = tok.token_bytes(token_id)
    text = raw.decode("utf-8", errors="replace") if raw or not tok.is_special(token_id) else tok.decode([token_id])
    # -inf (a token that cannot be drawn) as OpenAI shows it; JSON has no infinities
    return ShownToken(text, tuple(raw), logprob if logprob is None or math.isfinite(logprob) else -9999.0)


def with_logprobs(tok: ChatTokenizer, ev: TokenEvent, bos_added: bool = False) -> TokenEvent:
    """`ev` with its logprobs and its prompt's as clients see them (token texts and bytes), when it carries any.
    `bos_added`: the prompt's <|bos|> was put there by this deployment, so it is not the client's: its entry
    goes, and the client's first token, like any prompt's first, shows no logprob."""
    update = {}
    if ev.logprob is not None:
        update["logprobs"] = ShownLogprobs(shown_token(tok, ev.token, ev.logprob),
                                           tuple(shown_token(tok, t, lp) for t, lp in ev.top_logprobs))
    if ev.prompt_logprobs is not None:
        entries = ev.prompt_logprobs[1:] if bos_added else ev.prompt_logprobs
        update["prompt_entries"] = tuple(
            ShownLogprobs(shown_token(tok, t, lp if i else None), tuple(shown_token(tok, a, v) for a, v in top or ())
                          if i else ()) for i, (t, lp, top) in enumerate(entries))
    return msgspec.structs.replace(ev, **update) if update else ev


async def merged(streams: list, n: int) -> AsyncIterator[list[TokenEvent]]:
    """Several engine streams (one per prompt, each of n samples) as one: a batch of events whenever any stream has
    one, each event's sample index moved to prompt * n + sample (OpenAI's choice order)."""
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    batch = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield [msgspec.structs.replace(ev, index=i * n + ev.index) for ev in batch]
    finally:
        for fut in pending:
            fut.cancel()


async def grouped(batches: AsyncIterator[list[TokenEvent]], interval: int) -> AsyncIterator[list]:
    """The engine's batches as messages to the Ingress: until the client has seen output, every batch at once;
    then held until `interval` tokens have gathered or a sample ends. A sample that fails ends the stream with
    MODEL_FAILED, an engine that dies with ENGINE_STOPPED, each after the events held."""
    out: list[TokenEvent] = []
    held, shown = 0, False
    try:
        async for batch in batches:
            for ev in batch:
                if ev.finish_reason == "error":
                    yield out + [MODEL_FAILED]
                    return
                out.append(ev)
            held += sum(1 for ev in batch if ev.token is not None)
            if out and (not shown or held >= interval or out[-1].finish_reason):
                yield out
                shown = shown or any(ev.shows_output for ev in out)
                out, held = [], 0
    except EngineDied:
        yield out + [ENGINE_STOPPED]
        return
    if out:
        yield out


@serve.deployment(name="ChatModel")
class ChatModel:
    def __init__(self, settings: ChatSettings, start_engine=start_engine):
        """settings: the chat part of AppArgs. start_engine(Start, on_stats) -> an EngineClient (the engine's
        client; tests hand a scripted one)."""
        self.settings = settings
        self.defaults = load_chat_defaults(settings.checkpoint)
        self.name = settings.name
        self.metrics = ChatMetrics(self.name)
        tok, cfg = load_chat_tokenizer(settings.checkpoint)
        self.tok, self.sequence_len = tok, cfg.sequence_len
        self.prompter = ChatPrompter(tok, cfg.sequence_len, self.defaults.fewshot)
        start = Start(settings.checkpoint, settings.device, settings.engine, tuple(self.prompter.prefix_ids))
        self.engine = start_engine(start, on_stats=self.metrics.engine_stats)
        logger.info("chat model %s loaded (%s, %d rows, %s)", self.name, type(self.engine).__name__,
                    settings.engine.max_rows, getattr(self.engine, "info", None))

    def info(self) -> dict:
        d = self.defaults
        return {"id": self.name, "created": checkpoint_time(self.settings.checkpoint), "sequence_len": self.sequence_len,
                "max_n": self.engine.max_rows, "vocab_size": self.tok.vocab_size,
                "sampling_defaults": SamplingDefaults(d.temperature, d.top_k, d.top_p, d.max_tokens)}

    def stats(self) -> dict:
        s = self.engine.stats()
        return {"replica": serve.get_replica_context().replica_tag, "running": s.running, "waiting": s.waiting,
                "rows_used": s.rows_used, "rows_total": s.rows_total, "kv_cache_usage": s.cache_usage,
                "engine": type(self.engine).__name__,
                "prefix_cache": {"query_tokens": s.prefix_query_tokens, "hit_tokens": s.prefix_hit_tokens,
                                 "cached_rows": s.cached_rows, "cached_tokens": s.cached_prefix_tokens}}

    def detokenize(self, ids: list[int]) -> str:
        """Token ids as text, without <|bos|> (a completion's echo of a token-id prompt)."""
        return self.tok.decode([i for i in ids if i != self.tok.bos_id])

    def check_health(self) -> None:
        if not self.engine.alive():
            raise RuntimeError("the chat engine has stopped")

    def _prompt_ids(self, request: GenerateRequest) -> tuple[list[list[int]], list[bool]]:
        """The chat template over `messages`, or the raw `prompts` of a completion (text or token ids), each
        after <|bos|> as the model was trained; -> (the prompts' ids, whether each got its <|bos|> here)."""
        max_tokens = request.params.max_tokens
        if request.messages is not None:
            return [self.prompter.render(list(request.messages), max_tokens).ids], [False]
        out, added = [], []
        for i, p in enumerate(request.prompts):
            ids = self.tok.encode(p) if isinstance(p, str) else list(p)
            added.append(ids[:1] != [self.tok.bos_id])
            ids = [self.tok.bos_id] + ids if added[-1] else ids
            if len(ids) + max_tokens > self.sequence_len:
                raise PromptError(f"prompt {i} has {len(ids)} tokens; with max_tokens {max_tokens} it does "
                                  f"not fit the model's context of {self.sequence_len}", "prompt")
            out.append(ids)
        return out, added

    async def _open(self, request: GenerateRequest, streams: list) -> tuple[AsyncIterator, list[TokenEvent], list]:
        """One engine stream per prompt (into `streams`), merged; -> (the stream, its first batch, whether each
        prompt got its <|bos|> here). Raises what the prompter or the engine refuses."""
        prompts, bos_added = self._prompt_ids(request)
        if request.resume and len(prompts) != 1:
            raise EngineError("only a request of one prompt can continue an earlier generation")
        for ids in prompts:
            streams.append(self.engine.generate(ids, request.params, resume=list(request.resume) or None))
        stream = streams[0] if len(streams) == 1 else merged(streams, request.params.n)
        first = await stream.__anext__()
        self.metrics.prompted.inc(sum(len(ids) for ids in prompts))
        return stream, first, bos_added

    async def generate(self, request: GenerateRequest) -> AsyncIterator[list]:
        """Lists of TokenEvents (with logprobs as clients see them), every event ready at that moment in one list
        (once text has gone out, held until `stream_interval` tokens have gathered or a sample ends). With
        several prompts, sample i of prompt p has index p * n + i. A refused request yields one [StreamError];
        a failure mid-way ends the stream with one."""
        arrival = time.monotonic()
        streams: list = []
        try:
            stream, first, bos_added = await self._open(request, streams)
        except REFUSED as e:
            await close_all(streams)
            yield [refusal(e)]
            return
        last: dict[int, float] = {}
        p = request.params
        shows_logprobs = p.logprobs is not None or p.prompt_logprobs is not None

        async def batches():
            batch = first
            while True:
                self.metrics.tokens(batch, arrival, last)
                yield [with_logprobs(self.tok, ev, bos_added[ev.index // p.n]) for ev in batch] if shows_logprobs \
                    else batch
                try:
                    batch = await stream.__anext__()
                except StopAsyncIteration:
                    self.metrics.e2e.observe(time.monotonic() - arrival)
                    return

        try:
            async for message in grouped(batches(), self.settings.stream_interval):
                yield message
        finally:
            await stream.aclose()
            await close_all(streams)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


async def close_all(streams: list) -> None:
    for s in streams:
        await s.aclose()
