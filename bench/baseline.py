"""The baseline the HTTP benchmark compares against: chat served the way seed 001 serves it.

One generation at a time under a lock, no KV cache (every token re-runs the whole sequence), top-k
sampling, text streamed as server-sent events in OpenAI's chunk format. Same checkpoint, same prompter.
"""
from __future__ import annotations

import asyncio
import json
import threading

import torch
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from core.chat import ChatPrompter, load_chat_defaults, load_chat_model


def make_app(checkpoint: str) -> Starlette:
    model, tok, cfg = load_chat_model(checkpoint, device="cpu")
    prompter = ChatPrompter(tok, cfg.sequence_len, load_chat_defaults(checkpoint).fewshot)
    lock = threading.Lock()
    stop = {tok.encode_special("<|assistant_end|>"), tok.bos_id}

    def generate(messages, max_tokens, top_k, ignore_eos, out: asyncio.Queue, loop):
        with lock, torch.inference_mode():
            x = torch.tensor([prompter.render(messages, max_tokens).ids])
            decoder, n = tok.stream_decoder(), 0
            for _ in range(max_tokens):
                logits = model(x[:, -cfg.sequence_len:])[:, -1, :]
                vals, idx = torch.topk(logits, top_k, dim=-1)
                nxt = idx.gather(1, torch.multinomial(torch.softmax(vals, -1), 1))
                t = nxt.item()
                if t in stop and not ignore_eos:
                    break
                n += 1
                x = torch.cat([x, nxt], dim=1)
                loop.call_soon_threadsafe(out.put_nowait, "" if t in stop else decoder.feed(t))
            loop.call_soon_threadsafe(out.put_nowait, None)

    async def completions(request):
        body = await request.json()
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        args = (body["messages"], body.get("max_tokens", 128), 50, body.get("ignore_eos", False), queue, loop)
        threading.Thread(target=generate, args=args, daemon=True).start()

        async def events():
            while (text := await queue.get()) is not None:
                chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])
