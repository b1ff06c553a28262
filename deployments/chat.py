"""The chat deployment: one checkpoint and one continuous-batching engine per replica.

Many streams share the replica's engine (nanochat's old server and seed 001 served one request at a
time under a lock). `generate` is a streaming method: the ingress calls it through a streaming handle
and gets plain-dict events. If the caller goes away, the generator is closed or cancelled and the
engine aborts the request, freeing its cache rows at the next step. By default the engine steps in a child
process of the replica (core/chat/engine_process.py), so the model and the replica's event loop never wait on
each other's GIL; `engine_process=False` keeps it on a thread of the replica.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time
from typing import AsyncIterator

from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from core.chat import (ChatPrompter, ChatTokenizer, EngineError, EngineFull, PromptError, SamplingError,
                       SamplingParams, load_chat_defaults, load_chat_tokenizer)
from core.chat.engine_process import EngineDied, EngineSpec, start_engine

from .errors import error

logger = logging.getLogger(__name__)

GAUGE_PERIOD_S = 0.5   # engine gauges are sampled, not recomputed under the engine lock on every step
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
        self._gauges_at = 0.0
        for m in (self.ttft, self.itl, self.e2e, self.generated, self.prompted, self.running, self.waiting,
                  self.cache, self.prefix_queries, self.prefix_hits):
            m.set_default_tags(dict(tags))   # Serve adds its own tags to the dict it is given

    def engine_step(self, stats) -> None:
        """Called by the engine front with a stats getter (after each step, or as the engine process reports);
        the gauges refresh at most every GAUGE_PERIOD_S."""
        now = time.monotonic()
        if now - self._gauges_at < GAUGE_PERIOD_S:
            return
        self._gauges_at = now
        s = stats()
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.cache.set(s.cache_usage)
        queries, hits = self._reported
        if s.prefix_query_tokens > queries:
            self.prefix_queries.inc(s.prefix_query_tokens - queries)
        if s.prefix_hit_tokens > hits:
            self.prefix_hits.inc(s.prefix_hit_tokens - hits)
        self._reported = (max(queries, s.prefix_query_tokens), max(hits, s.prefix_hit_tokens))


def sampling_params(p: dict, defaults) -> SamplingParams:
    return SamplingParams(
        max_tokens=p.get("max_tokens") or defaults.max_tokens,
        temperature=defaults.temperature if p.get("temperature") is None else p["temperature"],
        top_k=defaults.top_k if p.get("top_k") is None else p["top_k"],
        top_p=defaults.top_p if p.get("top_p") is None else p["top_p"],
        seed=p.get("seed"), n=p.get("n") or 1, stop=list(p.get("stop") or []), ignore_eos=bool(p.get("ignore_eos")),
        presence_penalty=p.get("presence_penalty") or 0.0, frequency_penalty=p.get("frequency_penalty") or 0.0,
        repetition_penalty=p.get("repetition_penalty") or 1.0,
        logit_bias={int(k): float(v) for k, v in (p.get("logit_bias") or {}).items()}, logprobs=p.get("logprobs"))


def token_entry(tok: ChatTokenizer, token_id: int, logprob: float) -> dict:
    """A token as OpenAI's logprobs show it: its text, its UTF-8 bytes, its logprob. A special token shows its
    name and has no bytes; a token that is part of a multi-byte character shows U+FFFD and its own bytes."""
    raw = tok.token_bytes(token_id)
    text = raw.decode("utf-8", errors="replace") if raw or not tok.is_special(token_id) else tok.decode([token_id])
    # -inf (a token that cannot be drawn) as OpenAI shows it; JSON has no infinities
    return {"token": text, "bytes": list(raw), "logprob": logprob if math.isfinite(logprob) else -9999.0}


async def merged(streams: list, n: int) -> AsyncIterator[list]:
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
                yield [dataclasses.replace(ev, index=i * n + ev.index) for ev in batch]
    finally:
        for fut in pending:
            fut.cancel()


async def close_all(streams: list) -> None:
    for s in streams:
        await s.aclose()


@serve.deployment(name="ChatModel")
class ChatModel:
    def __init__(self, checkpoint: str, device: str | None = None, model_name: str | None = None,
                 max_rows: int = 32, prefill_chunk: int = 512, max_waiting: int = 256, engine_process: bool = True,
                 torch_threads: int | None = None, cuda_graphs: bool = True, engine_cpu_policy: str = "normal",
                 stream_interval: int = 1, prefix_caching: bool = True):
        """engine_process: step the model in a child process (the default; see core/chat/engine_process.py)
        rather than on a thread of the replica. torch_threads: torch's intra-op threads for the model.
        cuda_graphs: on CUDA, replay recorded graphs for decode passes (core/chat/cuda_graphs.py).
        engine_cpu_policy: "idle" runs the engine process under SCHED_IDLE, for CPU hosts (set_cpu_policy).
        prefix_caching: reuse the keys and values finished requests leave in their rows (core/chat/prefix_index.py).
        stream_interval: once a stream has shown output (text, or a closed calculator part), send its tokens to
        the ingress in messages of at least this many (1: every engine step's tokens at once); everything up to
        the first output, and the end of a stream, is never held back."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, not {stream_interval}")
        self.stream_interval = stream_interval
        self.defaults = load_chat_defaults(checkpoint)
        self.name = model_name or os.path.basename(os.path.normpath(checkpoint))
        self.metrics = ChatMetrics(self.name)
        tok, cfg = load_chat_tokenizer(checkpoint)
        self.tok = tok
        self.prompter = ChatPrompter(tok, cfg.sequence_len, self.defaults.fewshot)
        spec = EngineSpec(checkpoint, device, max_rows, prefill_chunk, max_waiting, self.prompter.prefix_ids,
                          torch_threads, cuda_graphs, engine_cpu_policy, prefix_caching)
        self.engine = start_engine(spec, engine_process, on_step=self.metrics.engine_step)
        self.sequence_len = cfg.sequence_len
        logger.info("chat model %s loaded (%s, %d rows, %s)", self.name, type(self.engine).__name__, max_rows,
                    getattr(self.engine, "info", {}))

    def info(self) -> dict:
        return {"id": self.name, "sequence_len": self.sequence_len, "max_n": self.engine.max_rows,
                "vocab_size": self.tok.vocab_size,
                "defaults": self.defaults.to_dict() | {"fewshot": len(self.defaults.fewshot)}}

    def stats(self) -> dict:
        s = self.engine.stats()
        return {"replica": serve.get_replica_context().replica_tag, "running": s.running, "waiting": s.waiting, "rows_used": s.rows_used, "rows_total": s.rows_total,
                "kv_cache_usage": s.cache_usage, "engine": type(self.engine).__name__,
                "prefix_cache": {"query_tokens": s.prefix_query_tokens, "hit_tokens": s.prefix_hit_tokens,
                                 "cached_rows": s.cached_rows, "cached_tokens": s.cached_prefix_tokens}}

    def detokenize(self, ids: list[int]) -> str:
        """Token ids as text, without <|bos|> (a completion's echo of a token-id prompt)."""
        return self.tok.decode([i for i in ids if i != self.tok.bos_id])

    def check_health(self) -> None:
        if not self.engine.alive():
            raise RuntimeError("the chat engine has stopped")

    def _prompt_ids(self, request: dict, params: SamplingParams) -> list[list[int]]:
        """The chat template over `messages`, or the raw `prompts` of a completion (text or token ids), each
        after <|bos|> as the model was trained."""
        if "messages" in request:
            return [self.prompter.render(request["messages"], params.max_tokens).ids]
        out = []
        for i, p in enumerate(request["prompts"]):
            ids = self.tok.encode(p) if isinstance(p, str) else list(p)
            ids = ids if ids[:1] == [self.tok.bos_id] else [self.tok.bos_id] + ids
            if len(ids) + params.max_tokens > self.sequence_len:
                raise PromptError(f"prompt {i} has {len(ids)} tokens; with max_tokens {params.max_tokens} it does "
                                  f"not fit the model's context of {self.sequence_len}", "prompt")
            out.append(ids)
        return out

    def _event(self, ev) -> dict:
        out = {"index": ev.index, "text": ev.text, "segment": ev.segment, "token": ev.token, "forced": ev.forced,
               "closes": ev.closes, "finish_reason": ev.finish_reason, "prompt_tokens": ev.prompt_tokens,
               "completion_tokens": ev.completion_tokens, "cached_tokens": ev.cached_tokens}
        if ev.logprob is not None:
            out["logprob"] = token_entry(self.tok, ev.token, ev.logprob) | {
                "top_logprobs": [token_entry(self.tok, t, lp) for t, lp in ev.top_logprobs]}
        return out

    async def generate(self, request: dict) -> AsyncIterator[list[dict]]:
        """request: {"messages": [...] | "prompts": [text | token ids, ...], "params": {...}} -> lists of events,
        each {"index", "text", "segment", "token", "forced", "closes", "finish_reason", "prompt_tokens",
        "completion_tokens", "cached_tokens"} (and "logprob" when asked): every event ready at that moment travels
        in one message (once text has gone out, held until `stream_interval` tokens have gathered or a sample
        ends). With several prompts, sample i of prompt p has index p * n + i. "resume": the token ids an earlier
        run of this request had delivered (one prompt, n=1): the stream continues that run, and its events are
        the tokens after them. A bad request yields one [{"error": ...}] instead."""
        arrival = time.monotonic()
        streams = []
        try:
            params = sampling_params(request.get("params", {}), self.defaults)
            prompts = self._prompt_ids(request, params)
            resume = request.get("resume")
            if resume and len(prompts) != 1:
                raise EngineError("only a request of one prompt can continue an earlier generation")
            for ids in prompts:
                streams.append(self.engine.generate(ids, params, resume=resume))
            stream = streams[0] if len(streams) == 1 else merged(streams, params.n)
            batch = await stream.__anext__()
        except (PromptError, SamplingError, EngineError) as e:
            await close_all(streams)
            yield [error(str(e), param=getattr(e, "param", None))]
            return
        except EngineFull as e:
            await close_all(streams)
            yield [error(f"the chat model is at capacity: {e}", "overloaded_error")]
            return
        except EngineDied:
            await close_all(streams)
            yield [error("the chat engine stopped; retry the request", "server_error")]
            return
        self.metrics.prompted.inc(sum(len(ids) for ids in prompts))
        last: dict[int, float] = {}
        out: list[dict] = []            # events not yet sent
        held = 0                        # tokens among them
        shown = False                   # output the client can see (text, or a closed calculator part) was sent
        try:
            while True:
                now = time.monotonic()
                tokens = 0
                for ev in batch:
                    if ev.token is not None:
                        tokens += 1
                        if ev.index in last:
                            self.metrics.itl.observe(now - last[ev.index])
                        else:
                            self.metrics.ttft.observe(now - arrival)
                        last[ev.index] = now
                    if ev.finish_reason == "error":
                        yield out + [error("the model failed while generating", "server_error")]
                        return
                    out.append(self._event(ev))
                if tokens:
                    self.metrics.generated.inc(tokens)
                held += tokens
                if out and (not shown or held >= self.stream_interval or out[-1]["finish_reason"]):
                    yield out       # until the client has seen output, every step's events go at once
                    shown = shown or any(e["closes"] or (e["text"] and e["segment"] == "text") for e in out)
                    out, held = [], 0
                batch = await stream.__anext__()
        except StopAsyncIteration:
            if out:
                yield out
            self.metrics.e2e.observe(time.monotonic() - arrival)
        except EngineDied:
            yield out + [error("the chat engine stopped while generating; retry the request", "server_error")]
        finally:
            await stream.aclose()
            await close_all(streams)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
