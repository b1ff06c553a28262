"""One stream's decode step in parts: the linear products, the attention kernel, and the rest (#55).

    python -m bench.step_parts [--shape 12x768] [--variant int8-fp32] [--threads 1] [--rounds 3] [--stack]

bench.single_stream's engine (the random GPT-2, a 64-token prompt, 128 new tokens, greedy; the blocks as modules,
`fused_decode` off), with the small-row kernel's products and the cache attention timed in place (a wall clock
around each call; torch's profiler does not see either, both being our extensions' functions). Per round: TPOT, the products' time a step and the rate
at which they read the weights, the attention's time a step, and the rest (torch's own ops, Python, the engine).
Then the products of the round's last step again, back to back on the same weights in the same order with
nothing between them: if they run faster so, the step's other work slows them (caches, prefetchers).
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

import core.chat.model as model_module
import core.chat.packed as packed_module
import core.chat.quantized as quantized_module
from bench.single_stream import VARIANTS, engine_for, one_run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="12x768")
    p.add_argument("--variant", default="int8-fp32", choices=tuple(VARIANTS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stack", action="store_true",
                   help="instead: the step with the blocks in one call (decode_stack.py), in its parts")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    layers, width = map(int, args.shape.lower().split("x"))
    engine = engine_for((layers, width), args.variant, 1)
    if args.stack:
        stack_parts(engine, args)
        return
    engine.fused_decode = False      # the blocks as modules, whose products and attention are timed one by one
    products, attention = [], [0.0]
    real_linear, real_attention = quantized_module.small_linear, model_module.cache_attention

    def timed_linear(x, w, scale=None, bias=None):
        t0 = time.perf_counter()
        y = real_linear(x, w, scale, bias)
        products.append((time.perf_counter() - t0, x, w, scale, bias))
        return y

    def timed_attention(q, *a, **k):
        t0 = time.perf_counter()
        y = real_attention(q, *a, **k)
        if q.size(2) == 1:                   # a decode pass (q: batch, heads, positions, head size), not the prefill
            attention[0] += time.perf_counter() - t0
        return y

    quantized_module.small_linear = packed_module.small_linear = timed_linear
    model_module.cache_attention = timed_attention
    print(f"{platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), GPT-2 {args.shape}, "
          f"{args.variant}, one stream, 64-token prompt, 128 new tokens")
    for r in range(args.rounds):
        products.clear()
        attention[0] = 0.0
        _, tpot = one_run(engine, 1, 64, 128, r)
        steps = 127                          # the decode steps (the prefill's products go to oneDNN)
        if not products:
            raise SystemExit(f"{args.variant}: no product went through the small-row kernel here")
        spent = sum(t for t, *_ in products) / steps
        read = sum(w.numel() * w.element_size() for _, _, w, _, _ in products) / steps
        attn = attention[0] / steps
        last = products[-(len(products) // steps):]
        t0 = time.perf_counter()
        for _ in range(40):
            for _, x, w, scale, bias in last:
                real_linear(x, w, scale, bias)
        alone = (time.perf_counter() - t0) / 40
        print(f"round {r}: TPOT {tpot * 1e3:.2f} ms = products {spent * 1e3:.2f} ({read / spent / 1e9:.1f} GB/s) "
              f"+ attention {attn * 1e3:.2f} + the rest {(tpot - spent - attn) * 1e3:.2f}; the same products back "
              f"to back {alone * 1e3:.2f} ms ({read / alone / 1e9:.1f} GB/s)")


def stack_parts(engine, args) -> None:
    """A decode step with the blocks in one call: the call, the rest of the model's forward (embeddings, final norm,
    head) and the engine's own work around the forward (the cache batch, sampling, events), ms a step."""
    if engine.decode_stack is None:
        raise SystemExit(f"{args.variant}: the engine runs no decode stack here")
    stack, model = engine.decode_stack, engine.model
    blocks, forwards = [], []
    real_forward = model.forward

    class Timed:                             # the engine hands this to each decode pass instead
        rows = stack.rows

        def __call__(self, *a):
            t0 = time.perf_counter()
            y = stack(*a)
            blocks.append(time.perf_counter() - t0)
            return y

    def timed_forward(ids, *a, **k):
        t0 = time.perf_counter()
        y = real_forward(ids, *a, **k)
        if ids.size(1) == 1:                 # decode passes only
            forwards.append(time.perf_counter() - t0)
        return y

    engine.decode_stack = Timed()
    model.forward = timed_forward
    print(f"{platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), GPT-2 {args.shape}, "
          f"{args.variant}, blocks in one call, one stream, 64-token prompt, 128 new tokens")
    for r in range(args.rounds):
        blocks.clear(), forwards.clear()
        _, tpot = one_run(engine, 1, 64, 128, r)
        b, f = sum(blocks) / len(blocks), sum(forwards) / len(forwards)
        print(f"round {r}: TPOT {tpot * 1e3:.2f} ms = blocks' call {b * 1e3:.2f} + the rest of the forward "
              f"{(f - b) * 1e3:.2f} + the engine around it {(tpot - f) * 1e3:.2f}")


if __name__ == "__main__":
    main()
