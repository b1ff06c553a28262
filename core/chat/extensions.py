"""The engine's C++ kernels (csrc/), each compiled once per machine on first use with torch's cpp_extension
(into its extensions cache; -march=native, since that cache is per machine). A kernel that cannot be built
(no compiler, a sandbox) is None: its caller keeps torch's own path, and one warning says why."""
from __future__ import annotations

import logging
import os
import shutil
import sys
import threading

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_lock = threading.Lock()
_built: dict[str, object | None] = {}


def extension(name: str, source: str, fallback: str):
    """The module built from csrc/`source` as `name`, or None where it cannot be built (then one warning: the
    build's error and `fallback`, what runs instead)."""
    if name in _built:          # every layer of every pass asks: no lock once the build was tried
        return _built[name]
    with _lock:
        if name not in _built:
            path = os.path.join(CSRC, source)
            try:
                from torch.utils.cpp_extension import load

                # the ninja that `pip install` put beside this interpreter, when none is on PATH (a venv not
                # activated, a Ray worker's environment)
                here = os.path.dirname(sys.executable)
                if shutil.which("ninja") is None and os.path.exists(os.path.join(here, "ninja")):
                    os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
                # -ffast-math lets the compiler vectorise sums whose order the source fixes (so a row computes
                # the same in any batch)
                module = load(name=name, sources=[path], extra_cflags=["-O3", "-march=native", "-ffast-math",
                                                                        "-fopenmp"], extra_ldflags=["-fopenmp"])
            except Exception as e:  # noqa: BLE001 - any failure leaves torch's own path, which always works
                logger.warning("%s: building %s failed (%s: %s)", fallback, path, type(e).__name__, e)
                module = None
            _built[name] = module   # after the attempt: a thread that sees it sees its result
    return _built[name]


def build_all() -> dict[str, bool]:
    """Build every kernel the chat engine uses on a CPU now (each once per machine; later calls find them built)
    -> {kernel: whether it built}. A service's replicas otherwise build them as their engines start, which on a
    fresh 2-core machine takes minutes; an image's build step or a test session can run this first
    (`python -m core.chat.extensions`)."""
    from . import attention, decode_stack, small_linear

    return {"cache_attention": attention.kernel() is not None, "small_linear": small_linear.kernel() is not None,
            "decode_stack": decode_stack.kernel() is not None}


if __name__ == "__main__":
    for name, built in build_all().items():
        print(f"{name}: {'built' if built else 'not built (see the warning above)'}")
