"""Memory the decision process hands back to the system between batches (glibc's allocator)."""
from __future__ import annotations

import ctypes
import time


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
    memory creeps up although nothing is held (bench/README.md, "An hour of mixed traffic"). A trim walks the heaps
    and releases their free pages: a few milliseconds, once in a while."""

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


def resident_kb(pid: int | str = "self") -> int:
    """A process's resident memory as the kernel counts it (VmRSS, in kB; 0 where /proc does not say)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
