"""The chat deployment: one checkpoint and one continuous-batching engine per replica.

Many streams share the replica's engine. `generate` is a streaming method: the Ingress calls it through a streaming handle with a
`GenerateRequest` and gets messages of `Delta`s, msgpack-encoded (core/chat/protocol.py). If the caller goes
away, the generator is closed or cancelled and the engine aborts the request, freeing its cache rows at the next step.
By default the engine steps in a child process of the replica (core/chat/engine_process.py), so the model and
the replica's event loop never wait on each other's GIL; `chat_engine_process: false` keeps it on a thread.

A generation here is: prompt ids (the chat template, or raw prompts after <|bos|>), one engine stream per
prompt (merged), then one loop over the engine client's deliveries (held as `stream_interval` and
`stream_interval_s` say, in the engine client's receiving thread): metrics once per delivery, the delivery's
events as Deltas (a choice's consecutive tokens in one record, logprobs as clients see them), one encoded
message to the Ingress: the first through Serve, the rest on the Ingress replica's token channel when the
request has a ticket for it (deployments/channel.py: one frame per loop turn for all of the replica's
streams to that Ingress replica).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from core.chat import ChatPrompter, PromptError, load_chat_defaults, load_chat_tokenizer
from core.chat.engine_process import start_engine
from core.chat.protocol import (ENGINE_STOPPED_CODE, ChatModelInfo, EngineDied, EngineError, EngineFull, EngineStart,
                                EngineStats, GenerateRequest, OnChannel, SamplingError, StreamError, TokenEvent,
                                encode_message)

from .channel import END, Channel, ChannelLost, ChannelPool
from .deltas import deltas
from .gauges import kept
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
        self.running = Gauge("chat_running_requests", "Requests holding KV-cache blocks.", tag_keys=("model",))
        self.waiting = Gauge("chat_waiting_requests", "Requests waiting for rows or blocks (preempted ones "
                             "included).", tag_keys=("model",))
        # vLLM's kv_cache_usage_perc, num_preemptions
        self.cache = Gauge("chat_kv_cache_usage", "Share of KV-cache blocks held by running requests (0-1).",
                           tag_keys=("model",))
        self.free_blocks = Gauge("chat_kv_cache_free_blocks", "KV-cache blocks held by no request (free or caching "
                                 "a prefix).", tag_keys=("model",))
        self.cached_blocks = Gauge("chat_kv_cache_cached_blocks", "KV-cache blocks held by no request that cache a "
                                   "prefix.", tag_keys=("model",))
        self.preemptions = Counter("chat_preemptions_total", "Running requests whose KV-cache blocks were taken "
                                   "back, to be computed again.", tag_keys=("model",))
        # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens
        self.prefix_queries = Counter("chat_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                                      tag_keys=("model",))
        self.prefix_hits = Counter("chat_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                                   tag_keys=("model",))
        self.linear_fallback = Gauge("chat_linear_fallback", "1 where packing the model's linear layers for "
                                     "oneDNN failed and they run on torch's slower F.linear.", tag_keys=("model",))
        self._reported = (0, 0, 0)
        for m in (self.linear_fallback, self.ttft, self.itl, self.e2e, self.generated, self.prompted, self.running, self.waiting,
                  self.cache, self.free_blocks, self.cached_blocks, self.preemptions, self.prefix_queries,
                  self.prefix_hits):
            m.set_default_tags(dict(tags))   # Serve adds its own tags to the dict it is given

    def engine_stats(self, s: EngineStats) -> None:
        """The engine's counters, as its client reports them (every STATS_PERIOD_S while it is busy)."""
        kept(self.running).set(s.running)
        kept(self.waiting).set(s.waiting)
        kept(self.cache).set(s.cache_usage)
        kept(self.free_blocks).set(s.blocks_total - s.blocks_used)
        kept(self.cached_blocks).set(s.blocks_cached)
        queries, hits, preempted = self._reported
        if s.prefix_query_tokens > queries:
            self.prefix_queries.inc(s.prefix_query_tokens - queries)
        if s.prefix_hit_tokens > hits:
            self.prefix_hits.inc(s.prefix_hit_tokens - hits)
        if s.preemptions > preempted:
            self.preemptions.inc(s.preemptions - preempted)
        self._reported = (max(queries, s.prefix_query_tokens), max(hits, s.prefix_hit_tokens),
                          max(preempted, s.preemptions))

    def tokens(self, batch: list[TokenEvent], arrival: float, last: dict[int, float]) -> None:
        """Time to first token, inter-token latency and the token count of one delivery of events, observed once
        per sample per delivery (as vLLM observes per engine output, not per token): a sample's inter-token
        latency is the time since its previous delivery. `last` keeps each sample's latest delivery time."""
        now, tokens, seen = time.monotonic(), 0, set()
        for ev in batch:
            if ev.token is not None:
                tokens += 1
                seen.add(ev.index)
        for i in seen:
            if i in last:
                self.itl.observe(now - last[i])
            else:
                self.ttft.observe(now - arrival)
            last[i] = now
        if tokens:
            self.generated.inc(tokens)


def refusal(e: Exception) -> StreamError:
    """The error a client sees for a generation the replica could not start (one place for the mapping)."""
    if isinstance(e, EngineFull):
        return StreamError(f"the chat model is at capacity: {e}", "overloaded_error")
    if isinstance(e, EngineDied):
        return StreamError("the chat engine stopped; retry the request", "server_error", code=ENGINE_STOPPED_CODE)
    return StreamError(str(e), param=getattr(e, "param", None))


REFUSED = (PromptError, SamplingError, EngineError, EngineFull, EngineDied)
MODEL_FAILED = StreamError("the model failed while generating", "server_error")
ENGINE_STOPPED = StreamError("the chat engine stopped while generating; retry the request", "server_error",
                             code=ENGINE_STOPPED_CODE)
CHANNEL_LOST = StreamError("the chat stream's connection to the Ingress was lost; retry the request", "server_error",
                           code=ENGINE_STOPPED_CODE)


async def merged(streams: list) -> AsyncIterator[tuple[int, list[TokenEvent]]]:
    """Several engine streams (one per prompt) as one: (the prompt's place, a delivery of its events) whenever
    any stream has one."""
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
                yield i, batch
    finally:
        for fut in pending:
            fut.cancel()


async def numbered(stream) -> AsyncIterator[tuple[int, list[TokenEvent]]]:
    """One engine stream in merged's form."""
    async for batch in stream:
        yield 0, batch


@serve.deployment(name="ChatModel")
class ChatModel:
    def __init__(self, settings: ChatSettings, start_engine=start_engine):
        """settings: the chat part of AppArgs. start_engine(EngineStart, on_stats) -> an EngineClient (the engine's
        client; tests hand a scripted one)."""
        self.settings = settings
        self.defaults = load_chat_defaults(settings.checkpoint)
        self.name = settings.name
        self.metrics = ChatMetrics(self.name)
        tok, cfg = load_chat_tokenizer(settings.checkpoint)
        self.tok, self.sequence_len = tok, cfg.sequence_len
        self.prompter = ChatPrompter(tok, cfg.sequence_len, self.defaults.fewshot, self.defaults.tool_format)
        start = EngineStart(settings.checkpoint, settings.device, settings.engine, tuple(self.prompter.prefix_ids))
        self.engine = start_engine(start, on_stats=self.metrics.engine_stats, hold=settings.hold)
        self.channels = ChannelPool()
        self.fallback = 1 if self.engine.linear == "torch-fallback" else 0
        kept(self.metrics.linear_fallback).set(self.fallback)
        logger.info("chat model %s loaded (%s, %d rows, %s)", self.name, type(self.engine).__name__,
                    settings.engine.max_rows, getattr(self.engine, "info", None))

    def info(self) -> ChatModelInfo:
        return ChatModelInfo(self.name, checkpoint_time(self.settings.checkpoint), self.sequence_len,
                             self.engine.max_rows, self.tok.vocab_size, self.defaults.sampling, self.defaults.tool_format)

    def stats(self) -> dict:
        s = self.engine.stats()
        return {"replica": serve.get_replica_context().replica_tag, "running": s.running, "waiting": s.waiting,
                "rows_used": s.rows_used, "rows_total": s.rows_total, "kv_cache_usage": s.cache_usage,
                "engine": type(self.engine).__name__, "engine_backend": self.settings.engine.backend,
                "linear": self.engine.linear, "attention": self.engine.attention, "dtype": self.engine.dtype,
                "decode": self.engine.decode,
                "kv_cache": {"blocks_total": s.blocks_total, "blocks_used": s.blocks_used,
                             "blocks_free": s.blocks_total - s.blocks_used, "blocks_cached": s.blocks_cached,
                             "block_size": s.block_size, "preemptions": s.preemptions, "evictions": s.evictions},
                "prefix_cache": {"query_tokens": s.prefix_query_tokens, "hit_tokens": s.prefix_hit_tokens,
                                 "cached_blocks": s.blocks_cached, "cached_tokens": s.blocks_cached * s.block_size}}

    def detokenize(self, ids: list[int]) -> str:
        """Token ids as text, without <|bos|> (a completion's echo of a token-id prompt)."""
        return self.tok.decode([i for i in ids if i != self.tok.bos_id])

    def tokenize(self, messages: tuple[dict, ...] | None, prompt: str | None, bos: bool, generation_prompt: bool,
                 token_strs: bool) -> dict:
        """/tokenize: the ids the chat template gives `messages` (the prompt of a request with max_tokens 1,
        history cut to fit as there; without the closing <|assistant_start|> if not `generation_prompt`), or the
        ids of `prompt` (after <|bos|> if `bos`). -> {"tokens", "token_strs"}, or {"error", "param"}."""
        if messages is not None:
            try:
                ids = self.prompter.render(list(messages), 1).ids
            except PromptError as e:
                return {"error": str(e), "param": e.param}
            ids = ids if generation_prompt else ids[:-1]
        else:
            ids = ([self.tok.bos_id] if bos else []) + self.tok.encode(prompt)
        return {"tokens": ids, "token_strs": [self.tok.decode([i]) for i in ids] if token_strs else None}

    def decode(self, ids: list[int]) -> str:
        """/detokenize: token ids as text, special tokens by name."""
        return self.tok.decode(ids)

    def check_health(self) -> None:
        if not self.engine.alive():
            raise RuntimeError("the chat engine has stopped")
        # Ray's agent drops a gauge not set again within two report intervals: Serve's health check (every
        # health_check_period_s) keeps this one a live series while the replica is up
        kept(self.metrics.linear_fallback).set(self.fallback)

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

    async def _open(self, request: GenerateRequest, streams: list):
        """One engine stream per prompt (into `streams`), as one; -> (the stream, its first delivery, whether
        each prompt got its <|bos|> here). Raises what the prompter or the engine refuses."""
        prompts, bos_added = self._prompt_ids(request)
        if request.resume and len(prompts) != 1:
            raise EngineError("only a request of one prompt can continue an earlier generation")
        for ids in prompts:
            streams.append(self.engine.generate(ids, request.params, resume=list(request.resume) or None))
        stream = numbered(streams[0]) if len(streams) == 1 else merged(streams)
        first = await stream.__anext__()
        self.metrics.prompted.inc(sum(len(ids) for ids in prompts))
        return stream, first, bos_added

    async def _channel(self, request: GenerateRequest) -> Channel | None:
        """The request's token channel to its Ingress replica, or None: none offered, or it cannot be reached
        (then the stream keeps to its Serve call)."""
        if request.channel is None:
            return None
        try:
            return await self.channels.get(request.channel)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, PermissionError) as e:
            logger.warning("token channel to %s:%d failed (%r); streaming through Serve", request.channel.host,
                           request.channel.port, e)
            return None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[bytes]:
        """The stream's messages: each one delivery of the engine client (everything ready for the stream at
        that moment; after its first text, held as `stream_interval` and `stream_interval_s` say) as Deltas,
        encoded (protocol.encode_message). With several prompts, sample i of prompt p is choice p * n + i. A
        refused request is one message of one StreamError; a failure mid-way ends the stream with one. With a
        token channel (request.channel), the first message starts with OnChannel and the rest, then END, go on
        the channel; this call still ends only when the generation does, and a failure (the engine's, or the
        channel's) goes through it, as a message the Ingress takes for a lost replica."""
        arrival = time.monotonic()
        streams: list = []
        try:
            stream, first, bos_added = await self._open(request, streams)
        except REFUSED as e:
            await close_all(streams)
            yield encode_message([refusal(e)])
            return
        channel = await self._channel(request)
        number = request.channel.stream if channel is not None else 0
        last: dict[int, float] = {}
        n = request.params.n
        try:
            prompt, batch = first
            records: list = [OnChannel()] if channel is not None else []
            first_message = True           # goes through Serve; with a channel, the rest go on it
            while True:
                self.metrics.tokens(batch, arrival, last)
                failed = next((k for k, ev in enumerate(batch) if ev.finish_reason == "error"), None)
                if failed is not None:
                    records += deltas(self.tok, batch[:failed], prompt * n, bos_added[prompt]) + [MODEL_FAILED]
                else:
                    records += deltas(self.tok, batch, prompt * n, bos_added[prompt])
                if channel is None or first_message:
                    yield encode_message(records)
                    first_message = False
                else:
                    channel.put(number, encode_message(records))
                    await channel.drained()
                if failed is not None:
                    break
                records = []
                try:
                    prompt, batch = await stream.__anext__()
                except StopAsyncIteration:
                    self.metrics.e2e.observe(time.monotonic() - arrival)
                    break
            if channel is not None:
                channel.put(number, END)
                await channel.sent()
        except EngineDied:                 # through Serve either way: the Ingress continues from what it has
            yield encode_message([ENGINE_STOPPED])
        except ChannelLost:                # the channel broke under a live replica: the same, from what arrived
            yield encode_message([CHANNEL_LOST])
        finally:
            await stream.aclose()
            await close_all(streams)

    def __del__(self):
        channels = getattr(self, "channels", None)
        if channels is not None:
            channels.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


async def close_all(streams: list) -> None:
    for s in streams:
        await s.aclose()
