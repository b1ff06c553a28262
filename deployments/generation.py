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
    """The SSE body: one write per batch of ready events, the first batch's with the opening chunks before it,
    and the batch that finishes every choice with the closing chunks (chat: the usage chunk when asked) and the
    end marker (chat: [DONE]) after it: every write costs a socket write here and in HAProxy. `completion`
    encodes them (a Completion, or the Responses API's ResponseBuilder). A failure ends it with an error
    event, never a hang; one after every choice finished loses nothing and ends it as usual."""
    encode = completion.encode
    text = [encode(chunk) for chunk in completion.first_chunks()]
    try:
        batch = first
        while True:
            for event in batch:
                if isinstance(event, StreamError):
                    yield "".join(text) + encode(completion.error_chunk(APIError.of(event).body)) + completion.done
                    return
                text += [encode(chunk) for chunk in completion.feed(event)]
            if text and not completion.finished:   # a finished one's last chunks wait for the end, right behind
                yield "".join(text)
                text = []
            try:
                batch = await stream.__anext__()
            except StopAsyncIteration:
                break
    except Exception as e:   # lost mid-stream and not continued: end with an error event, never hang
        if not completion.finished:
            logger.warning("chat stream failed: %r", e)
            yield "".join(text) + encode(completion.error_chunk(INTERRUPTED)) + completion.done
            return
    finally:
        stream.cancel()      # the client went away (or we are done): free the engine's rows
        slot.release()
    yield "".join(text + [encode(chunk) for chunk in completion.last_chunks(include_usage)] + [completion.done])
