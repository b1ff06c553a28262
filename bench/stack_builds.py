"""Builds of the decode stack side by side: the same engine on kernels compiled with different macros (#55).

    python -m bench.stack_builds --defines INT8_PREFETCH=0 INT8_PREFETCH=2048 [--variant int8-fp32]
                                 [--threads 1] [--rounds 4] [--shape 12x768] [--streams 1]

Each `--defines` entry (macros separated by commas; `-` for none) compiles core/chat/csrc/decode_stack.cpp (with
the small_linear.cpp and cache_attention.cpp it includes) under a module name of its own, the flags the engine
builds with plus those macros, and gives bench.single_stream's engine of `--variant` (the random GPT-2, one
stream, or `--streams` of them, 64-token prompts, 128 new tokens, greedy) that build's stack. The engines then run in turn, every build
once a round: TPOT of each round, the best. How the int8 prefetch distance was chosen (bench/README.md,
"Prefetching int8 weights on AVX2").
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform

import torch

import core.chat.decode_stack as decode_stack
from bench.single_stream import VARIANTS, engine_for, one_run
from core.chat.extensions import CSRC


def build(defines: str):
    """decode_stack.cpp compiled with `defines` ("A=1,B" or "-") under a name of its own."""
    from torch.utils.cpp_extension import load

    macros = [] if defines == "-" else [d for d in defines.split(",") if d]
    name = "stack_build_" + hashlib.sha1(defines.encode()).hexdigest()[:10]
    return load(name=name, sources=[os.path.join(CSRC, "decode_stack.cpp")],
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"] + [f"-D{m}" for m in macros],
                extra_ldflags=["-fopenmp"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--defines", nargs="+", required=True)
    p.add_argument("--variant", default="int8-fp32", choices=tuple(VARIANTS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--shape", default="12x768")
    p.add_argument("--streams", type=int, default=1, help="streams decoding together (rows of a pass)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shape = tuple(map(int, args.shape.lower().split("x")))
    engines = {}
    real_kernel = decode_stack.kernel
    try:
        for defines in args.defines:
            module = build(defines)
            decode_stack.kernel = lambda module=module: module
            engine = engine_for(shape, args.variant, args.streams)
            if engine.decode_stack is None or engine.decode_stack.mod is not module:
                raise SystemExit(f"{args.variant}: the engine does not run the stack")
            engines[defines] = engine
    finally:
        decode_stack.kernel = real_kernel
    print(f"{platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), GPT-2 {args.shape}, "
          f"{args.variant}, {args.streams} stream(s), 64-token prompts, 128 new tokens", flush=True)
    tpot = {d: [] for d in engines}
    for r in range(args.rounds):
        for d, engine in engines.items():
            tpot[d].append(one_run(engine, args.streams, 64, 128, r)[1] * 1e3)
    for d, times in tpot.items():
        print(f"{d:>28}: TPOT {' '.join(f'{t:.2f}' for t in times)} ms, best {min(times):.2f}")


if __name__ == "__main__":
    main()
