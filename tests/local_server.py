"""A Starlette app served by uvicorn on a free loopback port, on a thread of the test process (stand-in servers
for client tests)."""
from __future__ import annotations

import contextlib
import socket
import threading

import uvicorn

from tests.waiting import wait_until


@contextlib.contextmanager
def local_server(app):
    """Serve `app` until the block ends: -> its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the test server did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
