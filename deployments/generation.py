"""One chat generation over HTTP: started on a chat replica, then streamed as server-sent events or gathered
into one response. The slot the generation holds in the Ingress's admission goes back when it ends."""
from __future__ import annotations

import logging

from fastapi.responses import StreamingResponse

from core.chat.protocol import StreamError

from .admission import Slot
from .errors import APIError, error
from .resume import ChatStream

logger = logging.getLogger(__name__)

INTERRUPTED = error("the chat stream was interrupted by a server fault; retry the request", "server_error")


async def respond(stream: ChatStream, completion, streamed: bool, include_usage: bool, slot: Slot):
    """Start `stream` (retried while no replica answers); a refusal is raised as an APIError. Then an SSE
    response that takes `slot` along, or the gathered response."""
    try:
        first = await stream.start()
    except StopAsyncIteration:
        raise APIError(error("the model ended the stream without output", "server_error")) from None
    if isinstance(first[0], StreamError):
        stream.cancel()
        raise APIError.of(first[0])
    if streamed:
        return StreamingResponse(events(stream, first, completion, include_usage, slot),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        batch = first
        while True:
            for event in batch:
                if isinstance(event, StreamError):
                    raise APIError.of(event)
                completion.feed(event)
            batch = await stream.__anext__()
    except StopAsyncIteration:
        pass
    finally:
        stream.cancel()
        slot.release()
    return completion.response()


async def events(stream: ChatStream, first: list, completion, include_usage: bool, slot: Slot):
    """The SSE body: the first chunks, one write per batch of ready events, the closing chunks (chat: the usage
    chunk when asked), then the end marker (chat: [DONE]). `completion` encodes them (a Completion, or the
    Responses API's ResponseBuilder). A failure ends it with an error event, never a hang."""
    encode = completion.encode
    try:
        for chunk in completion.first_chunks():
            yield encode(chunk)
        batch, failed = first, False
        while not failed:
            text = []
            for event in batch:
                if isinstance(event, StreamError):
                    text.append(encode(completion.error_chunk(APIError.of(event).body)))
                    failed = True
                    break
                text += [encode(chunk) for chunk in completion.feed(event)]
            if text:
                yield "".join(text)
            if failed:
                break
            try:
                batch = await stream.__anext__()
            except StopAsyncIteration:
                for chunk in completion.last_chunks(include_usage):
                    yield encode(chunk)
                break
        yield completion.done
    except Exception as e:   # lost mid-stream and not continued: end with an error event, never hang
        logger.warning("chat stream failed: %r", e)
        yield encode(completion.error_chunk(INTERRUPTED))
        yield completion.done
    finally:
        stream.cancel()      # the client went away (or we are done): free the engine's rows
        slot.release()
