"""Gauges that keep their value while nothing changes.

Ray exports a gauge's value to its metrics agent when it is set, and the agent drops a value that was not set
again within about two export intervals (`ray._private.telemetry`, the gauge TTL). A gauge set only when its
value changes (the decision replica's prefix-cache bytes after a batch, the chat engine's counters while it is
busy) would vanish from Prometheus once its replica goes idle, and a dashboard would show "no data" exactly
when the value is steady. `kept(gauge).set(...)` sets the gauge and has one daemon thread per process set
every kept value again every `PERIOD_S`.
"""
from __future__ import annotations

import threading
import time

PERIOD_S = 5.0      # below the agent's TTL (2 x max(metrics_report_interval_ms, 1 s); 20 s at Ray's defaults)

_lock = threading.Lock()
_values: dict[tuple[int, tuple], tuple[object, float, dict | None]] = {}   # (gauge, tags) -> (gauge, value, tags)
_thread: threading.Thread | None = None


class Kept:
    """A gauge whose every set value (per tag set) is set again every PERIOD_S until it is set otherwise."""

    def __init__(self, gauge):
        self.gauge = gauge

    def set(self, value: float, tags: dict | None = None) -> None:
        self.gauge.set(value, tags=tags)
        with _lock:
            _values[(id(self.gauge), tuple(sorted((tags or {}).items())))] = (self.gauge, value, tags)
        _start()


def kept(gauge) -> Kept:
    return Kept(gauge)


def refresh() -> int:
    """Set every kept value again (what the thread does each period); how many."""
    with _lock:
        held = list(_values.values())
    for gauge, value, tags in held:
        gauge.set(value, tags=tags)
    return len(held)


def _start() -> None:
    global _thread
    with _lock:
        if _thread is not None:
            return
        _thread = threading.Thread(target=_loop, name="kept-gauges", daemon=True)
        _thread.start()


def _loop() -> None:
    while True:
        time.sleep(PERIOD_S)
        try:
            refresh()
        except Exception:       # a metrics hiccup must never end the replica's reporting for good
            pass
