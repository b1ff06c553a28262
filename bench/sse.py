"""A lean HTTP/1.1 client for the load generator: JSON POSTs over one keep-alive connection, with the
response's server-sent-event lines read as they arrive.

On the 2-core benchmark machine the load generator shares the CPU with the service it measures, so its own
cost per chunk shows up in the service's latency. This client does only what the benchmark needs (no
connection pool, redirects, cookies or compression) on asyncio streams, at a fraction of httpx's CPU per
chunk. Bodies come chunked (`Transfer-Encoding: chunked`, what uvicorn sends for a streaming response) or
with a `Content-Length`.
"""
from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit


class StreamTally:
    """What a streamed chat completion delivered, line by line: when each chunk with output (text, or a
    calculator part) arrived, and the completion tokens of its usage chunk (ask for one with
    `stream_options.include_usage`). A chunk may carry several tokens (the service merges a stream's held
    tokens into one delta), so tokens are counted from usage; a server that sends no usage chunk (the seed-001
    baseline: one token per chunk) has its output chunks counted instead."""

    def __init__(self):
        self.times: list[float] = []
        self.usage_tokens: int | None = None

    def line(self, line: str) -> None:
        if not line.startswith("data: {"):
            return
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            self.usage_tokens = chunk["usage"]["completion_tokens"]
        choices = chunk.get("choices")
        if choices and (choices[0]["delta"].get("content") or choices[0]["delta"].get("parts")):
            self.times.append(time.perf_counter())

    @property
    def tokens(self) -> int:
        return len(self.times) if self.usage_tokens is None else self.usage_tokens

    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's benchmark's TPOT), None under two tokens."""
        return (self.times[-1] - self.times[0]) / (self.tokens - 1) if self.times and self.tokens > 1 else None


class HTTPStatusError(RuntimeError):
    def __init__(self, status: int, body: bytes, headers: dict[str, str] | None = None):
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status
        self.headers = headers or {}


class Connection:
    """One keep-alive connection to `url`'s host; one request at a time."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/")
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _send(self, path: str, body: bytes) -> None:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"POST {self.base}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nAccept: text/event-stream\r\n\r\n")
        self.writer.write(head.encode() + body)
        await self.writer.drain()

    async def _head(self) -> tuple[int, dict[str, str]]:
        status = int((await self.reader.readline()).split()[1])
        headers = {}
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                return status, headers
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()

    async def _body(self, headers: dict[str, str]):
        """Yield the body's pieces as they arrive."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    while (await self.reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass   # trailers
                    return
                data = await self.reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in headers:
            yield await self.reader.readexactly(int(headers["content-length"]))
        else:   # the server closes the connection to end the body
            yield await self.reader.read()
            self.close()

    async def post_pieces(self, path: str, payload: dict):
        """POST `payload` as JSON; yield the response body's pieces (bytes) as they arrive. Raises
        HTTPStatusError on a status other than 200 (after reading the body, so the connection stays usable)."""
        await self._send(path, json.dumps(payload).encode())
        status, headers = await self._head()
        if status != 200:
            body = b"".join([piece async for piece in self._body(headers)])
            raise HTTPStatusError(status, body, headers)
        async for piece in self._body(headers):
            yield piece
        if headers.get("connection", "").lower() == "close":
            self.close()

    async def post_lines(self, path: str, payload: dict):
        """POST `payload` as JSON; yield the response's lines as they arrive (as post_pieces)."""
        buffer = b""
        async for piece in self.post_pieces(path, payload):
            buffer += piece
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if buffer:
            yield buffer.decode()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def closed_loop(url: str, bodies: list, clients: int, path: str = "/v1/systemone", expect: int = 200) -> dict:
    """`clients` closed-loop connections, client i POSTing bodies i, i + clients, ... and reading each answer
    whole: requests/s and latency percentiles (ms). Every answer must have status `expect` (at a GPU's rate
    httpx's CPU per request would outweigh the serving path it measures)."""
    latencies: list[float] = []

    async def worker(mine: list) -> None:
        conn = Connection(url)
        try:
            for body in mine:
                t0 = time.perf_counter()
                try:
                    async for _ in conn.post_pieces(path, body):
                        pass
                    status = 200
                except HTTPStatusError as e:
                    status = e.status
                if status != expect:
                    raise RuntimeError(f"status {status}, expected {expect}")
                latencies.append(time.perf_counter() - t0)
        finally:
            conn.close()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(bodies[i::clients]) for i in range(clients)))
    wall = time.perf_counter() - t0
    return {"requests": len(bodies), "seconds": wall, "requests_per_s": len(bodies) / wall,
            "p50_ms": 1e3 * percentile(latencies, 0.5), "p99_ms": 1e3 * percentile(latencies, 0.99)}
