"""The HTTP ingress: OpenAI-compatible chat, the /v1/systemone decision API, models, health, errors, keys.

Routes requests to the chat deployment (through a streaming handle) and the decision deployment.
Every error leaves as OpenAI's error JSON; `STATUS` in errors.py and the handlers below are the one
place where exception types become status codes.
"""

import asyncio
import collections
import hmac
import json
import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from ray.serve.metrics import Counter
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.decision.types import DecisionRequest, DecisionResponse

from .errors import CODE_STATUS, STATUS, error
from .openai_api import (ChatCompletionRequest, ChatCompletionResponse, Completion, ErrorResponse, Health, ModelList,
                         TextCompletion, TextCompletionRequest, TextCompletionResponse, sse, unsupported)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
# A replica (or its node) died under the call. Decisions are idempotent, and a chat generation is continued from
# what it had delivered (ChatStream), so such calls are retried: Serve routes the retry to a healthy replica once
# it knows.
REPLICA_LOST = (RayActorError, ActorUnavailableError)


# The web page (deployments/web): static files from the package, served at / and /ui/<file>, under a policy that
# runs only the page's own script and style (no inline script, no eval) and talks only to this origin.
WEB = Path(__file__).resolve().parent / "web"
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
              "app.css": "text/css; charset=utf-8"}
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


class APIError(Exception):
    def __init__(self, body: dict, headers: dict | None = None):
        self.body, self.headers = body, headers or {}


class Admission:
    """At most `limit` generations in flight from this Ingress replica, `waiting` more waiting for a slot here,
    and anything beyond refused at once, before its body is read: a 503 then costs almost nothing, where a
    request queued in Serve's router keeps probing the chat replicas for room (and under a retry storm those
    probes, not the model, saturate the machine). A refusal is answered after `refusal_delay_s`: a client that
    resends at once, ignoring Retry-After, then costs one cheap refusal per delay instead of one per round trip.
    limit None: no limit here (Serve's queue decides)."""

    def __init__(self, limit: int | None, waiting: int, refusal_delay_s: float = 0.0):
        self.limit, self.max_waiting, self.refusal_delay_s = limit, waiting, refusal_delay_s
        self.free = limit or 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def in_flight(self) -> int:
        return (self.limit or 0) - self.free

    async def enter(self) -> "Slot":
        if self.limit is None:
            return Slot(None)
        if self.free > 0:
            self.free -= 1
            return Slot(self)
        if len(self._waiters) >= self.max_waiting:
            if self.refusal_delay_s:
                await asyncio.sleep(self.refusal_delay_s)
            raise APIError(error("the chat model is at capacity; retry shortly", "overloaded_error",
                                 code="overloaded"))
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut                       # a leaving slot is handed over to us
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._leave()               # handed over just as we gave up: pass it on
            else:
                self._waiters.remove(fut)
            raise
        return Slot(self)

    def _leave(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


class Slot:
    """One admitted generation; `release` gives the slot back, once, however often it is called (and when the
    slot is dropped unreleased, e.g. with a response stream that never started)."""

    def __init__(self, admission: Admission | None):
        self._admission = admission

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._leave()

    def __del__(self):
        self.release()


class ChatStream:
    """The event batches of one generation on the chat replicas. When the replica streaming it is lost mid-way,
    the generation goes on on another one from the tokens received so far (ChatModel.generate's "resume": the new
    replica prefills them after the prompt and replays their tool, text and sampler state), retried with backoff
    for up to retry_timeout_s: the reader sees one uninterrupted stream, and a greedy or seeded generation gives
    the tokens an unbroken run would have. Only a generation of one prompt and one sample continues (the engine
    resumes one sample's state); another ends with the error, as does one whose retries run out."""

    def __init__(self, ingress: "Ingress", payload: dict, resumable: bool):
        self.ingress, self.payload, self.resumable = ingress, payload, resumable
        self.stream = None
        self.tokens: list[int] = []        # token ids received, in order (the one sample's)
        self.ended = False                 # a finish or an error event was received
        self.continued = 0                 # times the generation moved to another replica

    async def start(self) -> list[dict]:
        """The first batch of events; the start is retried while no replica answers."""
        return await self.ingress._retrying(lambda: self._open(self.payload), "chat")

    async def _open(self, payload: dict) -> list[dict]:
        self.cancel()
        self.stream = self.ingress.chat_stream.generate.remote(payload)
        return self._record(await self.stream.__anext__())

    def _record(self, batch: list[dict]) -> list[dict]:
        for ev in batch:
            if ev.get("token") is not None:
                self.tokens.append(ev["token"])
            if ev.get("finish_reason") or "error" in ev:
                self.ended = True
        return batch

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[dict]:
        try:
            return self._record(await self.stream.__anext__())
        except REPLICA_LOST as e:
            if not self.resumable or self.ended:
                raise
            self.continued += 1
            self.ingress.streams_continued.inc()
            self.ingress.continued_total += 1
            logger.warning("chat replica lost mid-stream (%s) after %d tokens; continuing on another replica",
                           type(e).__name__, len(self.tokens))
            payload = self.payload | {"resume": list(self.tokens)}
            return await self.ingress._retrying(lambda: self._open(payload), "chat")

    def cancel(self) -> None:
        """Stop the generation on its replica (its rows are freed at the engine's next step)."""
        if self.stream is not None:
            self.stream.cancel()


def status_of(body: dict) -> int:
    err = body["error"]
    return CODE_STATUS.get(err.get("code"), STATUS.get(err.get("type"), 500))


def error_response(body: dict, headers: dict | None = None) -> JSONResponse:
    status = status_of(body)
    if status == 503:
        headers = {"Retry-After": RETRY_AFTER_S, **(headers or {})}
    return JSONResponse({"error": body["error"]}, status_code=status, headers=headers)


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    parts, param = [], None
    for e in errs[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        param = param or loc or None
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request", param


app = FastAPI(title="startlux-serve", docs_url=None, redoc_url=None)

# (path, method) -> (request body model or None, response model, streams); the handlers parse bodies themselves
# (bounded reads, OpenAI-shaped errors), so the published schema is assembled from the models here.
ROUTE_MODELS = {
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, ChatCompletionResponse, True),
    ("/v1/completions", "post"): (TextCompletionRequest, TextCompletionResponse, True),
    ("/v1/systemone", "post"): (DecisionRequest, DecisionResponse, False),
    ("/v1/models", "get"): (None, ModelList, False),
    ("/healthz", "get"): (None, Health, False),
}
ERROR_STATUSES = {"400": "bad request: the message names the field", "401": "a missing or wrong API key",
                  "404": "unknown route or model", "413": "body over max_body_bytes",
                  "500": "a server fault", "503": "at capacity: retry after Retry-After seconds"}


def openapi_schema() -> dict:
    """OpenAPI 3.1 for every route, with the real request and response models."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    schema = get_openapi(title=app.title, version="1", routes=app.routes)
    models = {m for req, resp, _ in ROUTE_MODELS.values() for m in (req, resp) if m} | {ErrorResponse}
    _, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                 ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    ref = lambda m: {"$ref": f"#/components/schemas/{m.__name__}"}   # noqa: E731
    errors = {code: {"description": what, "content": {"application/json": {"schema": ref(ErrorResponse)}}}
              for code, what in ERROR_STATUSES.items()}
    for (path, method), (req, resp, streams) in ROUTE_MODELS.items():
        op = schema["paths"][path][method]
        op.pop("parameters", None)
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(req)}}}
        content = {"application/json": {"schema": ref(resp)}}
        if streams:
            content["text/event-stream"] = {"schema": {   # one server-sent event
                "type": "object", "required": ["data"],
                "properties": {"event": {"type": "string"},
                               "data": {"type": "string", "description": "a JSON chunk, an error, or [DONE]"}}}}
        op["responses"] = {"200": {"description": "OK", "content": content}} | (errors if path != "/healthz" else {
            "503": {"description": "a model deployment does not answer", "content": {
                "application/json": {"schema": ref(Health)}}}})
    for path in list(schema["paths"]):
        if path.startswith("/debug"):
            schema["paths"][path]["get"]["responses"] = {"200": {"description": "the replicas' counters",
                                                                  "content": {"application/json": {}}}} | errors
    app.openapi_schema = schema
    return schema


app.openapi = openapi_schema


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError):
    return error_response(exc.body, exc.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    msg, param = validation_message(exc)
    return error_response(error(msg, param=param))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    body = error(str(exc.detail) if exc.status_code != 404 else f"no route {request.method} {request.url.path}", kind)
    return JSONResponse({"error": body["error"]}, status_code=exc.status_code)


@app.exception_handler(Exception)
async def _fault(request: Request, exc: Exception):
    logger.exception("unhandled error on %s", request.url.path)
    return error_response(error("internal error", "server_error"))


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, chat: DeploymentHandle, decision: DeploymentHandle, api_keys: list[str] | None = None,
                 max_body_bytes: int = 1_000_000, max_messages: int = 256, max_message_chars: int = 32_000,
                 max_n: int = 8, max_questions: int = 64, retry_timeout_s: float = 60.0,
                 max_chat_inflight: int | None = None, max_chat_waiting: int = 64, refusal_delay_s: float = 0.0):
        self.chat, self.decision = chat, decision
        self.chat_stream = chat.options(stream=True)   # built once: options() per request costs a handle copy
        self.api_keys = [k for k in (api_keys or []) if k]
        self.max_body_bytes, self.max_messages, self.max_message_chars = max_body_bytes, max_messages, max_message_chars
        self.max_n, self.max_questions = max_n, max_questions
        self.retry_timeout_s = retry_timeout_s
        self.chat_admission = Admission(max_chat_inflight, max_chat_waiting, refusal_delay_s)
        self.streams_continued = Counter("chat_streams_continued_total",
                                         "Generations moved to another chat replica after theirs was lost.")
        self.continued_total = 0
        self.page = {name: (WEB / name).read_bytes() for name in PAGE_FILES}
        self._chat_info: dict | None = None
        self._decision_info: dict | None = None

    # ---- shared checks
    def _authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not any(hmac.compare_digest(token, k) for k in self.api_keys):
            raise APIError(error("missing or invalid API key (send Authorization: Bearer <key>)",
                                 "invalid_request_error", code="invalid_api_key"))

    async def _json(self, request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise APIError(error(f"request body over {self.max_body_bytes} bytes", "invalid_request_error",
                                 code="body_too_large"))
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise APIError(error(f"request body over {self.max_body_bytes} bytes", "invalid_request_error",
                                     code="body_too_large"))
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(error(f"malformed JSON: {e}")) from None
        if not isinstance(data, dict):
            raise APIError(error("the request body must be a JSON object"))
        return data

    async def chat_info(self) -> dict:
        if self._chat_info is None:
            self._chat_info = await self.chat.info.remote()
        return self._chat_info

    async def decision_info(self) -> dict:
        if self._decision_info is None:
            self._decision_info = await self.decision.info.remote()
        return self._decision_info

    # ---- the web page (no key needed to load it: every API call it makes sends one)
    def _page_file(self, name: str) -> Response:
        if name not in PAGE_FILES:
            raise APIError(error(f"no page file {name!r}", "not_found_error"))
        return Response(self.page[name], media_type=PAGE_FILES[name], headers=PAGE_HEADERS)

    @app.get("/", include_in_schema=False)
    async def index(self, request: Request):
        path = request.url.path
        if not path.endswith("/"):      # under a route prefix: the page's relative links need the slash
            return RedirectResponse(path + "/" + (f"?{request.url.query}" if request.url.query else ""), 308)
        return self._page_file("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def page_asset(self, name: str):
        return self._page_file(name)

    # ---- routes
    @app.get("/healthz")
    async def healthz(self):
        try:
            await asyncio.wait_for(asyncio.gather(self.chat.info.remote(), self.decision.info.remote()), 5)
        except Exception as e:
            logger.warning("health check failed: %s", e)
            return JSONResponse({"status": "unavailable"}, status_code=503, headers={"Retry-After": RETRY_AFTER_S})
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        chat, decision = await asyncio.gather(self.chat_info(), self.decision_info())
        return {"object": "list", "data": [
            {"id": chat["id"], "object": "model", "owned_by": "startlux-serve", "kind": "chat"},
            {"id": decision["id"], "object": "model", "owned_by": "startlux-serve", "kind": "decision"},
            *({"id": alias, "object": "model", "owned_by": "startlux-serve", "kind": "decision",
               "alias_of": decision["id"]} for alias in decision["aliases"])]}

    @app.get("/debug/stats")
    async def stats(self, request: Request):
        """Per-replica engine and batching counters of the replicas that answer (for tests and operators)."""
        self._authorize(request)
        chat, decision = await asyncio.gather(self.chat.stats.remote(), self.decision.stats.remote())
        admission = self.chat_admission
        return {"chat": chat, "decision": decision,
                "ingress": {"chat_in_flight": admission.in_flight, "chat_waiting": len(admission._waiters),
                            "chat_limit": admission.limit, "chat_streams_continued": self.continued_total}}

    async def _parse(self, request: Request, schema, openai: bool = False):
        """Key check, bounded body, JSON, (for OpenAI routes) no unsupported parameter, schema: a parsed request or
        an APIError."""
        self._authorize(request)
        data = await self._json(request)
        if openai and (bad := unsupported(data)):
            name, what = bad
            raise APIError(error(f"`{name}` is not supported by this service ({what}); send the request without it",
                                 param=name, code="unsupported_parameter"))
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            msg, param = validation_message(e)
            raise APIError(error(msg, param=param)) from None

    @app.post("/v1/systemone")
    async def systemone(self, request: Request):
        req = await self._parse(request, DecisionRequest)
        if len(req.questions) > self.max_questions:
            raise APIError(error(f"at most {self.max_questions} questions per request", param="questions"))
        info = await self.decision_info()
        if req.model is not None and req.model != info["id"] and req.model not in info["aliases"]:
            raise APIError(error(f"unknown model {req.model!r}; this service decides with {info['id']!r}",
                                 "not_found_error", "model", "model_not_found"))
        if req.assets:
            raise APIError(error("`assets` (images for placeholders) are not supported by this decision model; "
                                 "send the request without them", param="assets", code="unsupported_parameter"))
        payload = {"state": req.state,
                   "questions": {k: q.model_dump(exclude_unset=True) for k, q in req.questions.items()}}
        result = await self._retrying(lambda: self.decision.decide.remote(payload), "decision")
        if "error" in result:
            raise APIError(result)
        return result

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._admitted(request, self._chat_completion)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._admitted(request, self._text_completion)

    async def _admitted(self, request: Request, handler):
        """Key check and a slot from the chat admission first (before the body is read), then `handler`; the
        slot goes back when the generation ends (with its stream, for a streamed response)."""
        self._authorize(request)
        slot = await self.chat_admission.enter()
        try:
            return await handler(request, slot)
        except BaseException:
            slot.release()
            raise

    async def _chat_completion(self, request: Request, slot: Slot):
        req = await self._parse(request, ChatCompletionRequest, openai=True)
        info = await self._chat_model(req.model)
        self._check_limits(req, info)
        self._check_sampling(req, req.max_completion_tokens or req.max_tokens, info)
        payload = {"messages": [m.for_prompter() for m in req.messages], "params": req.params()}
        return await self._generate(payload, Completion(info["id"], req.n, logprobs=req.logprobs), req, slot,
                                    resumable=req.n == 1)

    async def _text_completion(self, request: Request, slot: Slot):
        req = await self._parse(request, TextCompletionRequest, openai=True)
        info = await self._chat_model(req.model)
        prompts = req.prompts()
        if len(prompts) * req.n > min(self.max_n, info["max_n"]):
            raise APIError(error(f"prompts x n must be at most {min(self.max_n, info['max_n'])}", param="n"))
        for i, p in enumerate(prompts):
            if not isinstance(p, str) and max(p) >= info["vocab_size"]:
                raise APIError(error(f"prompt {i}: token ids must be below the vocabulary size {info['vocab_size']}",
                                     param="prompt"))
            if len(p) > self.max_message_chars:
                raise APIError(error(f"prompt {i} has {len(p)} {'characters' if isinstance(p, str) else 'tokens'}; "
                                     f"the limit is {self.max_message_chars}", param="prompt"))
        self._check_sampling(req, req.max_tokens, info)
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else await self.chat.detokenize.remote(p) for p in prompts]
        completion = TextCompletion(info["id"], req.n, len(prompts), logprobs=req.logprobs is not None, echo=echo)
        return await self._generate({"prompts": prompts, "params": req.params()}, completion, req, slot,
                                    resumable=req.n == 1 and len(prompts) == 1)

    async def _chat_model(self, model: str | None) -> dict:
        info = await self.chat_info()
        if model is not None and model != info["id"]:
            raise APIError(error(f"unknown model {model!r}; this service serves {info['id']!r}",
                                 "not_found_error", "model", "model_not_found"))
        return info

    async def _generate(self, payload: dict, completion: Completion, req, slot: Slot, resumable: bool):
        """Start the generation on a chat replica (retried while no replica answers), then stream its chunks or
        gather one response (either continued on another replica if its replica is lost: ChatStream). A streamed
        response takes `slot` along and gives it back when the stream ends."""
        stream = ChatStream(self, payload, resumable)
        try:
            first = await stream.start()
        except StopAsyncIteration:
            raise APIError(error("the model ended the stream without output", "server_error")) from None
        if "error" in first[0]:
            stream.cancel()
            raise APIError(first[0])
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._sse(stream, first, completion, include_usage, slot),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            batch = first
            while True:
                for event in batch:
                    if "error" in event:
                        raise APIError(event)
                    completion.feed(event)
                batch = await stream.__anext__()
        except StopAsyncIteration:
            pass
        finally:
            stream.cancel()
            slot.release()
        return completion.response()

    async def _sse(self, stream: ChatStream, first: list[dict], completion: Completion, include_usage: bool,
                   slot: Slot):
        try:
            for chunk in completion.first_chunks():
                yield sse(chunk)
            batch, failed = first, False
            while not failed:
                text = []
                for event in batch:
                    if "error" in event:
                        text.append(sse({"error": event["error"]}))
                        failed = True
                        break
                    text += [sse(chunk) for chunk in completion.feed(event)]
                if text:
                    yield "".join(text)       # one write per batch of ready tokens
                if failed:
                    break
                try:
                    batch = await stream.__anext__()
                except StopAsyncIteration:
                    if include_usage:
                        yield sse(completion.usage_chunk())
                    break
            yield "data: [DONE]\n\n"
        except Exception as e:   # lost mid-stream and not continued: end with an error event, never hang
            logger.warning("chat stream failed: %r", e)
            yield sse(error("the chat stream was interrupted by a server fault; retry the request", "server_error"))
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()      # the client went away (or we are done): free the engine's rows
            slot.release()

    def _check_limits(self, req: ChatCompletionRequest, info: dict) -> None:
        if len(req.messages) > self.max_messages:
            raise APIError(error(f"at most {self.max_messages} messages per request, got {len(req.messages)}",
                                 param="messages"))
        for i, m in enumerate(req.messages):
            parts = m.parts or (m.content if isinstance(m.content, list) else [])
            size = len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in parts)
            if size > self.max_message_chars:
                raise APIError(error(f"messages[{i}] has {size} characters; the limit is {self.max_message_chars}",
                                     param=f"messages[{i}].content"))
        if req.n > min(self.max_n, info["max_n"]):
            raise APIError(error(f"n must be at most {min(self.max_n, info['max_n'])}", param="n"))

    @staticmethod
    def _check_sampling(req, max_tokens: int | None, info: dict) -> None:
        if max_tokens is not None and max_tokens >= info["sequence_len"]:
            raise APIError(error(f"max_tokens must be below the model's context of {info['sequence_len']} tokens",
                                 param="max_tokens"))
        vocab = info["vocab_size"]
        if req.logit_bias and max(req.logit_bias) >= vocab:
            raise APIError(error(f"logit_bias token ids must be below the vocabulary size {vocab}",
                                 param="logit_bias"))

    async def _retrying(self, call, what: str):
        """Await `call()`; when the replica serving it is lost, call again (with backoff) until retry_timeout_s."""
        deadline = time.monotonic() + self.retry_timeout_s
        attempt = 0
        while True:
            try:
                return await self._call(call())
            except REPLICA_LOST as e:
                attempt += 1
                if time.monotonic() >= deadline:
                    raise APIError(error(f"the {what} model is unavailable; retry shortly", "overloaded_error",
                                         code="unavailable")) from None
                logger.warning("%s replica lost (%s); retry %d", what, type(e).__name__, attempt)
                await asyncio.sleep(min(0.05 * 2 ** attempt, 2.0))

    @staticmethod
    async def _call(awaitable):
        try:
            return await awaitable
        except BackPressureError:
            raise APIError(error("the service is at capacity; retry shortly", "overloaded_error",
                                 code="overloaded")) from None
