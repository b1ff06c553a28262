"""Waiting on state in tests: one deadline helper, for threads (`wait_until`) and event loops (`until`).

A test waits for the state it needs, polling `cond` until it is true, and fails naming what never happened
when `timeout` seconds pass first; it never sleeps a fixed time and hopes. The deadline is a bound against a
hang, not a timing assertion: a slow host only waits longer.
"""
from __future__ import annotations

import asyncio
import time


def _timed_out(what, timeout: float) -> AssertionError:
    return AssertionError(f"not within {timeout:g} s: {what() if callable(what) else what}")


def wait_until(cond, timeout: float, what="the condition", interval: float = 0.05, fail: bool = True):
    """Poll `cond()` until it is truthy: -> its value. After `timeout` seconds: an AssertionError naming `what`
    (text, or a callable that says what the state was), or with `fail` false `cond()`'s last value (a grace
    period: a process given that long to end before it is killed)."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() >= deadline:
            if fail:
                raise _timed_out(what, timeout)
            return got
        time.sleep(interval)
    return got


async def until(cond, timeout: float, what="the condition", interval: float = 0.01):
    """`wait_until` on an event loop: `cond` is polled between awaits, so the loop's other tasks run."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout)
        await asyncio.sleep(interval)
    return got
