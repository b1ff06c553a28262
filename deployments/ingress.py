"""The HTTP ingress: OpenAI-compatible chat, the /v1/systemone decision API, models, health, keys, limits.

Each route parses its body (bounded), finds the model it names in the registry (registry.py: every chat and
decision model of the config, each its own deployment), lets the request model check itself against that model's
info and the Ingress's limits, and hands it to the model's deployment (a chat model through a streaming handle).
The parts live beside it: openai_requests.py and responses_api.py (the request models, their checks and
SamplingParams), openai_shapes.py (every answer's shape), completion.py and responses_stream.py (a stream's
chunks and answer), admission.py (chat admission, and the 503 before routing), resume.py (retries, and
streams that continue on another replica), generation.py (SSE or one response), errors.py (the one mapping of
errors to statuses), openapi.py (the published schema), web/ (the page). This process runs no model: it
imports neither torch nor transformers (a test checks).
"""

import asyncio
import functools
import hmac
import logging

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
import ray
from ray import serve
from ray.serve.metrics import Gauge

from core.chat.protocol import ChatModelInfo, GenerateRequest, SamplingError, SamplingParams
from core.decision.protocol import DecisionRefused

from . import web
from .admission import Admission, RefuseWhenFull, Tally
from .bodies import read_json, validated
from .channel import ChannelServer
from .completion import Completion, TextCompletion
from .errors import RETRY_AFTER_S, APIError, error, install_handlers
from .gauges import kept
from .generation import respond
from .openai_requests import (ChatCompletionRequest, DetokenizeRequest, TextCompletionRequest, TokenizeRequest,
                              unsupported)
from .openai_shapes import DetokenizeResponse, Health, ModelCard, ModelList, TokenizeResponse
from .registry import Model, Registry
from .systemone import DecisionRequest
from .openapi import openapi_schema
from .responses_api import InputError, ResponsesRequest
from .responses_stream import ResponseBuilder
from .resume import ChatStream, RetryPolicy
from .settings import IngressSettings

logger = logging.getLogger(__name__)

app = FastAPI(title="startlux-serve", docs_url=None, redoc_url=None)
app.openapi = lambda: openapi_schema(app)
app.include_router(web.router)
install_handlers(app)
app.add_middleware(RefuseWhenFull)


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, models: list[dict], settings: IngressSettings):
        """models: {"kind", "names", "handle"} per model (app.wire); settings: the Ingress part of AppArgs, its API
        keys already read (IngressSettings.with_env_keys)."""
        self.registry, self.settings = Registry(models), settings
        self.api_keys = [k for k in settings.api_keys if k]
        self.retry = RetryPolicy(settings.retry_timeout_s)
        self.chat_refused = Tally("ingress_chat_refused_total",
                                  "Generations refused with 503 by the Ingress's admission.")
        self.admission_gauges = (Gauge("ingress_chat_in_flight", "Generations this Ingress replica has admitted.",
                                       tag_keys=("model",)),
                                 Gauge("ingress_chat_waiting", "Generations waiting in this Ingress for a slot.",
                                       tag_keys=("model",)))
        # one admission per chat model: each model's generations take its own slots
        self.chat_admissions = {m.name: Admission(settings.max_chat_inflight, settings.max_chat_waiting,
                                                  settings.refusal_delay_s,
                                                  on_change=functools.partial(self._admission_changed, m.name),
                                                  on_refusal=self.chat_refused.inc)
                                for m in self.registry.of_kind("chat")}
        # the token channel listens from first use, by default on this node's address (where chat replicas reach it)
        self.channel = (ChannelServer(settings.token_channel_host or ray.util.get_node_ip_address())
                        if settings.token_channel else None)
        self.streams_continued = Tally("chat_streams_continued_total",
                                       "Generations moved to another chat replica after theirs was lost.")
        app.state.ingress = self    # RefuseWhenFull reads the admission and key check here (one Ingress per process)

    @property
    def chat_full(self) -> bool:
        """Every chat model's admission would refuse the next generation: RefuseWhenFull refuses it before its
        body is read (which names the model)."""
        return bool(self.chat_admissions) and all(a.full for a in self.chat_admissions.values())

    async def chat_refusal(self) -> dict:
        """A refusal of RefuseWhenFull's, counted and delayed as each admission's own are."""
        return await next(iter(self.chat_admissions.values())).refusal()

    def _admission_changed(self, model: str, admission: Admission) -> None:
        in_flight, waiting = self.admission_gauges
        kept(in_flight).set(admission.in_flight, tags={"model": model})
        kept(waiting).set(admission.waiting, tags={"model": model})

    # ---- shared checks
    def authorized(self, header: str) -> bool:
        """Whether an Authorization header value carries one of the keys (always, when there are none)."""
        if not self.api_keys:
            return True
        token = header[7:] if header.lower().startswith("bearer ") else ""
        return any(hmac.compare_digest(token, k) for k in self.api_keys)

    def _authorize(self, request: Request) -> None:
        if not self.authorized(request.headers.get("authorization", "")):
            raise APIError(error("missing or invalid API key (send Authorization: Bearer <key>)",
                                 "invalid_request_error", code="invalid_api_key"))

    async def _parse(self, request: Request, schema, openai: bool = False):
        """Key check, bounded body, JSON, (for OpenAI routes) no unsupported parameter, schema: a parsed request or
        an APIError."""
        self._authorize(request)
        data = await read_json(request, self.settings.max_body_bytes, self.settings.max_json_depth)
        if openai and (bad := unsupported(data)):
            name, what = bad
            raise APIError(error(f"`{name}` is not supported by this service ({what}); send the request without it",
                                 param=name, code="unsupported_parameter"))
        return validated(schema, data)

    # ---- routes
    @app.get("/healthz")
    async def healthz(self):
        """200 when every model answers within 5 s; else 503, the body naming each model's state."""
        got = await self.registry.each(lambda m: m.handle.info.remote(), timeout=5)
        states = {name: "unavailable" if isinstance(r, BaseException) else "ok" for name, r in got.items()}
        if all(v == "ok" for v in states.values()):
            return Health(status="ok", models=states)
        logger.warning("health check failed for %s", ", ".join(f"{n} ({got[n]!r})" for n, v in states.items()
                                                             if v != "ok"))
        return JSONResponse(Health(status="unavailable", models=states), status_code=503,
                            headers={"Retry-After": RETRY_AFTER_S})

    @app.get("/v1/models")
    async def models(self, request: Request):
        """Every model that answers, with its aliases as cards of their own (`alias_of`)."""
        self._authorize(request)
        infos = await self.registry.each(Model.info)
        cards = []
        for m in self.registry.models:
            info = infos[m.name]
            if isinstance(info, BaseException):
                logger.warning("/v1/models: %s did not answer (%r)", m.name, info)
                continue
            card = lambda name, **alias: ModelCard(  # noqa: E731
                id=name, object="model", created=info.created, owned_by="startlux-serve", kind=m.kind, **alias)
            cards += [card(m.name), *(card(alias, alias_of=m.name) for alias in m.names[1:])]
        return ModelList(object="list", data=cards)

    @app.get("/debug/stats")
    async def stats(self, request: Request):
        """Per-replica engine and batching counters of each model's replicas that answer (for tests and operators):
        `models` by name; `chat` and `decision` are the first model of each kind's."""
        self._authorize(request)
        got = await self.registry.each(lambda m: m.handle.stats.remote())
        models = {m.name: {"kind": m.kind, **({"error": repr(got[m.name])} if isinstance(got[m.name], BaseException)
                                              else got[m.name])} for m in self.registry.models}
        first = {kind: models[ms[0].name] for kind in ("chat", "decision") if (ms := self.registry.of_kind(kind))}
        admissions = self.chat_admissions
        for name, a in admissions.items():
            models[name]["admission"] = {"in_flight": a.in_flight, "waiting": a.waiting}
        return {**first, "models": models,
                "ingress": {"chat_in_flight": sum(a.in_flight for a in admissions.values()),
                            "chat_waiting": sum(a.waiting for a in admissions.values()),
                            "chat_limit": self.settings.max_chat_inflight, "chat_refused": self.chat_refused.total,
                            "chat_streams_continued": self.streams_continued.total,
                            "token_channel": self.channel.stats() if self.channel is not None else None}}

    @app.post("/v1/systemone")
    async def systemone(self, request: Request):
        req = await self._parse(request, DecisionRequest)
        model = self.registry.get("decision", req.model)
        parsed = req.check(await model.info(), self.settings).to_bytes()
        result = await self.retry(lambda: model.handle.decide.remote(parsed), "decision")
        if isinstance(result, DecisionRefused):
            raise APIError.of(result)
        return Response(result, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._admitted(request, self._chat_completion)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._admitted(request, self._text_completion)

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a prompt's or a conversation's token ids, under the limits of a chat request."""
        req, model, info = await self._chat_request(request, TokenizeRequest)
        got = await model.handle.tokenize.remote(req.prompt_messages(info.tool_format), req.prompt,
                                              req.add_special_tokens is not False, req.add_generation_prompt,
                                              req.return_token_strs)
        if "error" in got:
            raise APIError(error(got["error"], param=got["param"]))
        return TokenizeResponse(count=len(got["tokens"]), max_model_len=info.sequence_len, tokens=got["tokens"],
                                token_strs=got["token_strs"])

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's /detokenize: token ids as text."""
        req, model, _ = await self._chat_request(request, DetokenizeRequest)
        return DetokenizeResponse(prompt=await model.handle.decode.remote(req.tokens))

    @app.post("/v1/responses")
    async def responses(self, request: Request):
        return await self._admitted(request, self._response)

    async def _response(self, request: Request):
        """OpenAI's Responses API, stateless: the request as a chat completion, its stream as Responses events."""
        req = await self._parse(request, ResponsesRequest)
        try:
            chat_req = req.to_chat()
        except InputError as e:
            raise APIError(error(str(e), param=e.param)) from None
        model, info = await self._checked(chat_req)
        params = await self._params(chat_req, info)
        gen = GenerateRequest(params, messages=chat_req.prompt_messages(info.tool_format))
        builder = ResponseBuilder(info.id, req, chat_req.tool_plan(info.tool_format), params)
        return await self._generate(model, gen, builder, chat_req, resumable=True)

    async def _admitted(self, request: Request, handler):
        """Key check first (before the body is read), then `handler`, which takes a slot of its model's admission
        in `_generate`."""
        self._authorize(request)
        return await handler(request)

    async def _chat_completion(self, request: Request):
        req, model, info = await self._chat_request(request, ChatCompletionRequest, openai=True)
        fmt = info.tool_format
        gen = GenerateRequest(await self._params(req, info), messages=req.prompt_messages(fmt))
        completion = Completion(info.id, req.n, logprobs=req.logprobs, tools=req.tool_plan(fmt))
        return await self._generate(model, gen, completion, req, resumable=req.n == 1)

    async def _text_completion(self, request: Request):
        req, model, info = await self._chat_request(request, TextCompletionRequest, openai=True)
        prompts = req.prompts()
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else await model.handle.detokenize.remote(p) for p in prompts]
        completion = TextCompletion(info.id, req.n, len(prompts), logprobs=req.logprobs is not None, echo=echo)
        gen = GenerateRequest(await self._params(req, info),
                              prompts=tuple(p if isinstance(p, str) else tuple(p) for p in prompts))
        return await self._generate(model, gen, completion, req, resumable=req.n == 1 and len(prompts) == 1)

    async def _chat_request(self, request: Request, schema, openai: bool = False):
        """A request for a chat model, parsed and checked against its limits: (request, the model, its info)."""
        req = await self._parse(request, schema, openai)
        return (req, *await self._checked(req))

    async def _checked(self, req) -> tuple[Model, ChatModelInfo]:
        """The chat model `req` names (404 for another name) and its info, `req` checked against its limits."""
        model = self.registry.get("chat", req.model)
        info = await model.info()
        req.check(info, self.settings)
        return model, info

    async def _generate(self, model: Model, gen: GenerateRequest, completion: Completion, req, resumable: bool):
        """A slot of `model`'s admission (waiting for one, or a 503), then the generation on one of its replicas,
        streamed or gathered (continued on another of its replicas if its replica is lost: ChatStream); the slot
        goes back when the generation ends (a streamed response takes it along, to its stream's end)."""
        slot = await self.chat_admissions[model.name].enter()
        try:
            stream = ChatStream(model.stream, gen, self.retry, resumable, self.streams_continued.inc, self.channel)
            return await respond(stream, completion, req.stream, req.include_usage, slot)
        except BaseException:
            slot.release()
            raise

    @staticmethod
    async def _params(req: ChatCompletionRequest | TextCompletionRequest, info: ChatModelInfo) -> SamplingParams:
        """The request's SamplingParams with the chat model's defaults; a value out of range, or a structured
        output that cannot be enforced, is a 400 naming it. A grammar is checked on a worker thread (a large
        schema takes milliseconds to compile, which the event loop does not wait for)."""
        try:
            if req.has_grammar:
                return await asyncio.to_thread(req.to_params, info)
            return req.to_params(info)
        except SamplingError as e:
            raise APIError(error(str(e), param=e.param)) from None
