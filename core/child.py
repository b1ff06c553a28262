"""A model in a child process of the serving replica, behind a private socket pair (torch-free).

Both models run this way (core/chat/engine_process.py, core/decision/process.py): in the replica's process,
the model's many small torch operations and the replica's event loop would take turns on one GIL. The
parent starts `python -m <module> <fd>` with one end of a socket pair, sends its Start record, and waits for
Ready (or Failed, whose message it raises). Records are pickled by multiprocessing's Connection. The child
exits when told to stop or when the socket closes, so it does not outlive its parent; the parent stops it by
its pid.
"""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # holds the `core` package


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

    def stop(self, stop_record, timeout_s: float = 10.0) -> None:
        """Ask the child to stop, then make sure: killed by its pid if it has not exited in time, or at once when
        it cannot be asked (the connection is closed: lost, or ended on a record this process could not read)."""
        self.stopping = True
        asked = False
        with self.lock:
            if not self.closed:
                try:
                    self.conn.send(stop_record)
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


class _Mallinfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (every field a size_t)."""
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


class MemoryReturn:
    """Hands the C allocator's free memory back to the system at most every `interval_s` (glibc's
    `malloc_trim(0)`; a no-op elsewhere).

    A decision pass allocates and frees tensors of many sizes (prefix states, keys of every length, activations of
    every batch shape); glibc keeps what is freed inside its heaps for reuse, so a long-running scorer's resident
    memory creeps up although nothing is held (bench/README.md, "An hour of mixed traffic": a scorer alone grew
    1.45 MB per 1,000 requests after its cache filled, and one trim gave back 20 of its 23 MB). A trim walks the
    heaps and releases their free pages: a few milliseconds, once in a while."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.last = time.monotonic()
        self.trims = 0
        self.after_trim: dict | None = None    # the heap as the last trim left it
        try:
            libc = ctypes.CDLL("libc.so.6")
            self._trim = libc.malloc_trim
        except (OSError, AttributeError):
            self._trim = libc = None
        self._mallinfo2 = getattr(libc, "mallinfo2", None)     # glibc 2.33 and later
        if self._mallinfo2 is not None:
            self._mallinfo2.restype = _Mallinfo2

    def maybe(self) -> bool:
        """Trim if `interval_s` has passed since the last one; whether it did."""
        if self._trim is None or self.interval_s <= 0 or time.monotonic() - self.last < self.interval_s:
            return False
        self.trim()
        return True

    def heap(self) -> dict | None:
        """glibc's own account of the heap, in bytes (None elsewhere): `in_use` by live allocations, `free`
        inside its heaps (what a trim can hand back, page by page), `mmapped` (large blocks, which go back
        to the system when freed)."""
        if self._mallinfo2 is None:
            return None
        info = self._mallinfo2()
        return {"in_use": info.uordblks, "free": info.fordblks, "mmapped": info.hblkhd,
                "heap": info.arena}

    def trim(self) -> None:
        """Trim now (where glibc is there), and read the heap it leaves."""
        if self._trim is not None:
            self._trim(0)
            self.last = time.monotonic()
            self.trims += 1
            self.after_trim = self.heap()

    def report(self) -> dict:
        """What /debug/stats shows: the trims so far and, in MB, the heap the last one left (its `in_use` is
        what the process holds; its `free` is what the allocator keeps for reuse)."""
        heap = {k: round(v / 2 ** 20, 1) for k, v in (self.after_trim or {}).items()}
        return {"returns": self.trims, **heap}


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
