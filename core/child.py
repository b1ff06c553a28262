"""A model in a child process of the serving replica, behind a private socket pair (torch-free).

Both models run this way (core/chat/engine_process.py, core/decision/process.py): in the replica's process,
the model's many small torch operations and the replica's event loop would take turns on one GIL. The
parent starts `python -m <module> <fd>` with one end of a socket pair, sends its start record (EngineStart,
ScorerStart), and waits for its ready record (EngineReady, ScorerReady) or `Failed`, whose message it raises.
Records are pickled by multiprocessing's Connection. The child exits when sent `Stop` or when the socket
closes, so it does not outlive its parent; the parent stops it by its pid.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

import msgspec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # holds the `core` package


class Failed(msgspec.Struct, frozen=True):
    """child -> parent, once, instead of its ready record: building the model failed (the traceback)."""

    message: str


class Stop(msgspec.Struct, frozen=True):
    """parent -> child: stop and exit."""


class Child:
    """The parent's side: the process, its connection, and sends that fail once it has gone."""

    def __init__(self, module: str, what: str, start, ready_type: type, start_timeout_s: float = 600.0):
        """Start `module` as a child, send it `start`, wait for a `ready_type` record -> `self.ready`.
        `what` names the child in errors ("the chat engine process")."""
        self.what = what
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env, cwd=ROOT)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.lock = threading.Lock()          # held by each send, and while the connection closes
        self.closed = self.stopping = False
        try:
            self.conn.send(start)
            self.ready = self._wait_ready(ready_type, start_timeout_s)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self, ready_type: type, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.conn.poll(0.5):
                try:
                    msg = self.conn.recv()
                except EOFError:
                    break
                if isinstance(msg, ready_type):
                    return msg
                raise RuntimeError(f"{self.what} failed to start:\n{getattr(msg, 'message', msg)}")
            if self.proc.poll() is not None:
                break
        raise RuntimeError(f"{self.what} did not start (exit code {self.proc.poll()})")

    def send(self, msg, died: type[Exception]) -> None:
        """Send `msg`; raises `died` once the child has gone."""
        with self.lock:
            if self.closed:
                raise died(f"{self.what} has stopped")
            try:
                self.conn.send(msg)
            except OSError as e:
                raise died(f"{self.what} has stopped ({e})") from None

    def records(self, logger, raw=None):
        """What the child sends, until the connection ends or a record cannot be read: then this process and the
        child no longer agree on the records (a child started from other code), nothing more from it can be
        trusted, and the error is logged. The caller's reader treats both as the child lost. `raw(data)`, when
        given, reads what the child sent with `send_bytes` in a form of its own (anything but a pickle, which
        starts with 0x80): the chat engine's events, in msgpack."""
        while True:
            try:
                if raw is None:
                    yield self.conn.recv()
                    continue
                data = self.conn.recv_bytes()
                yield ForkingPickler.loads(data) if data[:1] == b"\x80" else raw(data)
            except (EOFError, OSError):
                return
            except Exception:
                logger.exception("an unreadable record from %s %d", self.what, self.pid)
                return

    def alive(self) -> bool:
        return not self.closed and self.proc.poll() is None

    def lost(self, logger) -> None:
        """The reader saw the connection end: no send goes out after this (each raises its `died`), and an end
        nobody asked for is logged."""
        with self.lock:
            self.closed = True
        if not self.stopping:
            logger.error("lost the connection to %s %d", self.what, self.pid)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the child to stop (`Stop`), then make sure: killed by its pid if it has not exited in time, or at
        once when it cannot be asked (the connection is closed: lost, or ended on a record this process could not
        read)."""
        self.stopping = True
        asked = False
        with self.lock:
            if not self.closed:
                try:
                    self.conn.send(Stop())
                    asked = True
                except OSError:
                    pass
        if asked:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.close()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            try:
                self.conn.close()
            except OSError:
                pass


class ChildClient(ABC):
    """A model's client with the model in a child process (ProcessEngine, ProcessScorer): the child, a reader
    thread that hands each record it sends to `_receive` (on that thread), and, however the reading ends (the
    child gone, stopped, or a record this process cannot read), `_ended` once, after which every send fails."""

    child: Child
    logger: "logging.Logger"
    raw = None                  # Child.records' `raw`: how to read what the child sends with send_bytes

    def _start_child(self, module: str, what: str, start, ready_type: type, start_timeout_s: float,
                     reader: str):
        """Start the child (blocking until it is ready: `self.child.ready`) and the reader thread `reader`."""
        self.child = Child(module, what, start, ready_type, start_timeout_s)
        self.proc = self.child.proc
        self._reader = threading.Thread(target=self._read, name=reader, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for msg in self.child.records(self.logger, raw=self.raw):
                self._receive(msg)
        finally:
            self.child.lost(self.logger)
            self._ended()

    @abstractmethod
    def _receive(self, msg) -> None:
        """One record the child sent (on the reader thread)."""

    @abstractmethod
    def _ended(self) -> None:
        """Every call still waiting on the child fails (nobody waits forever)."""

    @property
    def pid(self) -> int:
        return self.child.pid

    def alive(self) -> bool:
        return self.child.alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the child to stop, then make sure: it is killed by its pid if it has not exited in time."""
        self.child.stop(timeout_s)


def child_main(argv: list[str], serve, name: str) -> int:
    """A child's entry point: `serve(conn)` on the socket the parent passed; a parent gone is a normal end."""
    import logging

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    conn = Connection(int(argv[0]))
    try:
        serve(conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass
    return 0
