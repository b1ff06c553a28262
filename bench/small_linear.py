"""The linear layers' products at a decode step's few rows: which path reads the weights fastest (#55).

    python -m bench.small_linear [--shapes 768x768 3072x768 768x3072 2048x768] [--rows 1 2 3 4 6 8 16]
                                 [--threads 1 2] [--rounds 3] [--streamed MB] [--json out.json]

For each weight shape (out x in features: GPT-2 small's q/k/v/o, MLP up, MLP down, head) and row count, every
path on the same input, alternating, best of `--rounds` rounds of timed calls each: core/chat/small_linear.py's
kernel on bf16, int8 (per output channel) and fp32 weights; oneDNN's product on the packed bf16 weight
(core/chat/packed.py, the engine's path for bf16); torch's F.linear on bf16 and fp32 weights (MKL for fp32);
torch's `_weight_int8pack_mm` (its own int8 weight-only product). Each figure is microseconds a call and the
rate at which it read the weight (GB/s). The row count where the kernel stops winning is what
packed.SMALL_ROWS and quantized.Int8Linear use.

A weight of a few MB stays in the core's caches between calls; a model's decode step streams every weight
from memory once. `--streamed MB`: each path multiplies, in turn, as many distinct weights of the shape as
make MB megabytes of bf16 (a 12 x 768 GPT-2 reads 174), so the figures are rates from memory: the kernel on
bf16, int8 (with bf16 or fp32 rows of x) and fp32 weights (half as many, the same bytes), oneDNN's packed bf16
where the CPU packs bf16, and `sum` (torch summing the bf16 weights) as this core's plain reading rate.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from core.chat.packed import packs
from core.chat.quantized import quantize
from core.chat.small_linear import kernel


def paths(n: int, k: int, rows: int):
    """name -> (callable, weight bytes read) for one shape and row count, all on one random weight."""
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) * 0.02
    q, scale = quantize(w)          # as chat_weights: int8 quantizes
    wb = w.bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, 32) if packs(torch.bfloat16) else None
    x = torch.randn(rows, k, generator=g)
    xb = x.bfloat16()
    ext = kernel()
    out = {
        "ours bf16": (lambda: ext.small_linear(xb, wb, None, None), 2 * n * k),
        "ours int8": (lambda: ext.small_linear(xb, q, scale, None), n * k),
        "ours fp32": (lambda: ext.small_linear(x, w, None, None), 4 * n * k),
        "oneDNN bf16 packed": (lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], ""), 2 * n * k),
        "F.linear bf16": (lambda: F.linear(xb, wb), 2 * n * k),
        "F.linear fp32": (lambda: F.linear(x, w), 4 * n * k),
        "torch int8pack": (lambda: torch._weight_int8pack_mm(xb, q, scale.bfloat16()), n * k),
    }
    if packed is None:              # this CPU cannot pack bf16 for oneDNN (no AVX-512 BW/VL/DQ, no AVX-NE-CONVERT)
        del out["oneDNN bf16 packed"]
    if rows > 8:
        out = {name: v for name, v in out.items() if not name.startswith("ours")}
    return out


def streamed(n: int, k: int, rows: int, mb: int, threads: int, rounds: int) -> dict:
    """Rates reading `mb` MB of distinct bf16 weights (int8: half the bytes, fp32: twice) from memory, per path;
    oneDNN's packed bf16 only where this CPU packs bf16."""
    torch.set_num_threads(threads)
    count = max(2, mb * 10 ** 6 // (2 * n * k))
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, k, generator=g).bfloat16() for _ in range(count)]
    quant = [quantize(w) for w in ws]
    full = [w.float() for w in ws[: max(1, count // 2)]]      # as many bytes as the bf16 weights
    x = torch.randn(rows, k, generator=g).bfloat16()
    xf = x.float()
    ext = kernel()
    paths = {"ours bf16": (lambda: [ext.small_linear(x, w, None, None) for w in ws], 2 * count),
             "ours int8": (lambda: [ext.small_linear(x, q, s, None) for q, s in quant], count),
             "ours int8, fp32 x": (lambda: [ext.small_linear(xf, q, s, None) for q, s in quant], count),
             "ours fp32": (lambda: [ext.small_linear(xf, w, None, None) for w in full], 4 * len(full)),
             "sum": (lambda: [w.sum() for w in ws], 2 * count)}
    if packs(torch.bfloat16):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws]
        paths["oneDNN bf16 packed"] = (lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                                for p in packed], 2 * count)
    best = {name: float("inf") for name in paths}
    for fn, _ in paths.values():
        fn()
    for _ in range(rounds):
        for name, (fn, _) in paths.items():
            best[name] = min(best[name], timed(fn, 1))
    row = {"shape": f"{n}x{k}", "rows": rows, "threads": threads, "streamed_MB": round(count * 2 * n * k / 1e6),
           "ms": {name: round(t * 1e3, 2) for name, t in best.items()},
           "GBps": {name: round(paths[name][1] * n * k / t / 1e9, 1) for name, t in best.items()}}
    print(f"{n}x{k} x {count} ({row['streamed_MB']} MB of bf16) rows {rows} threads {threads}, from memory: " +
          ", ".join(f"{name} {row['ms'][name]:.1f} ms ({row['GBps'][name]:.1f} GB/s)" for name in best), flush=True)
    return row


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def run(shapes: list[tuple[int, int]], rows: list[int], threads: int, rounds: int) -> list[dict]:
    torch.set_num_threads(threads)
    results = []
    for n, k in shapes:
        for r in rows:
            ps = paths(n, k, r)
            best = {name: float("inf") for name in ps}
            calls = max(20, int(2e8 / (n * k * 2)))          # ~0.1 s a path a round at 20 GB/s
            for fn, _ in ps.values():
                timed(fn, 5)
            for _ in range(rounds):                          # alternating: every path once a round
                for name, (fn, _) in ps.items():
                    best[name] = min(best[name], timed(fn, calls))
            row = {"shape": f"{n}x{k}", "rows": r, "threads": threads,
                   "us": {name: round(t * 1e6, 1) for name, t in best.items()},
                   "GBps": {name: round(ps[name][1] / t / 1e9, 1) for name, t in best.items()}}
            results.append(row)
            print(f"{n}x{k} rows {r:>2} threads {threads}: " + ", ".join(
                f"{name} {row['us'][name]:.0f} us ({row['GBps'][name]:.1f} GB/s)" for name in best), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["768x768", "3072x768", "768x3072", "2048x768"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streamed", type=int, metavar="MB", help="instead: distinct weights of MB megabytes in all, "
                   "read from memory")
    p.add_argument("--json")
    args = p.parse_args()
    if kernel() is None:
        raise SystemExit("the small-row kernel could not be built here (see the warning above)")
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    if args.streamed:
        results = [streamed(n, k, r, args.streamed, t, args.rounds) for t in args.threads for n, k in shapes
                   for r in args.rows]
    else:
        results = [row for t in args.threads for row in run(shapes, args.rows, t, args.rounds)]
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "results": results},
                                              indent=2))


if __name__ == "__main__":
    main()
