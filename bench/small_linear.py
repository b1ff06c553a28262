"""The linear layers' products at a decode step's few rows: which path reads the weights fastest (#55).

    python -m bench.small_linear [--shapes 768x768 3072x768 768x3072 2048x768] [--rows 1 2 3 4 6 8 16]
                                 [--threads 1 2] [--rounds 3] [--json out.json]

For each weight shape (out x in features: GPT-2 small's q/k/v/o, MLP up, MLP down, head) and row count, every
path on the same input, alternating, best of `--rounds` rounds of timed calls each: core/chat/small_linear.py's
kernel on bf16, int8 (per output channel) and fp32 weights; oneDNN's product on the packed bf16 weight
(core/chat/packed.py, the engine's path for bf16); torch's F.linear on bf16 and fp32 weights (MKL for fp32);
torch's `_weight_int8pack_mm` (its own int8 weight-only product). Each figure is microseconds a call and the
rate at which it read the weight (GB/s). The row count where the kernel stops winning is what
packed.SMALL_ROWS and quantized.Int8Linear use.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from core.chat.small_linear import kernel


def paths(n: int, k: int, rows: int):
    """name -> (callable, weight bytes read) for one shape and row count, all on one random weight."""
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) * 0.02
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    wb = w.bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, 32)
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
    if rows > 8:
        out = {name: v for name, v in out.items() if not name.startswith("ours")}
    return out


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
    p.add_argument("--json")
    args = p.parse_args()
    if kernel() is None:
        raise SystemExit("the small-row kernel could not be built here (see the warning above)")
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    results = [row for t in args.threads for row in run(shapes, args.rows, t, args.rounds)]
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "results": results},
                                              indent=2))


if __name__ == "__main__":
    main()
