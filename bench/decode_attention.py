"""A decode step's time against the keys and values it must read, with the batch's rows contiguous in the cache
and scattered over it (what they become once requests come and go).

    python -m bench.decode_attention [--shape 4x256] [--rows 32] [--positions 64 256 768 1536]
                                     [--dtypes float32 bfloat16] [--threads 1] [--block-size 16]
                                     [--json out.json]

A random GPT-2 of `--shape` (the demo vocabulary, context 2048) and a paged cache with room for every row's
whole context; every row of the batch at the same position, its blocks (`--block-size`) one after another
(contiguous) or interleaved with the other rows' (scattered). Per position and dtype, alternating: the model's
decode forward and the attention path the engine takes on this machine (attention.py),
and the bare attention of one layer (the CPU kernel where built, else SDPA over the gathered rows). GB/s: the keys
and values the step must read (rows x layers x 2 x heads x head size x position x bytes) over the forward's time,
and over the attention's alone. Prints a table; figures go in bench/README.md with date and machine.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from bench.engine_profile import parse_shape
from bench.vllm_peer import random_gpt2
from core.chat import attention
from core.chat.kv_cache import CacheBatch, KVCache


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4x256")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--positions", type=int, nargs="+", default=[64, 256, 768, 1536])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16, help="positions per KV-cache block")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n_layer, n_embd = parse_shape(args.shape)
    base, _ = random_gpt2(n_layer, n_embd, sequence_len=2048)
    n = args.rows
    bs = args.block_size
    per = 2048 // bs

    def tables(layout):
        """Each row's blocks one after another (contiguous) or the rows' blocks interleaved (scattered)."""
        if layout == "contiguous":
            return [[list(range(1 + r * per, 1 + (r + 1) * per))] for r in range(n)]
        return [[list(range(1 + r, 1 + n * per, n))] for r in range(n)]

    layouts = {name: tables(name) for name in ("contiguous", "scattered")}
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s); "
          f"{args.shape}, {n} rows; decode attention: {attention.path(torch.device('cpu'))}")
    print(f"{'dtype':>9}{'position':>9}{'layout':>11}{'step ms':>9}{'GB/s':>7}{'attn ms':>9}{'GB/s':>7}")
    out = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        model = random_gpt2(n_layer, n_embd, sequence_len=2048)[0].to(dtype)
        cfg = model.config
        cache = KVCache.for_model(cfg, 1 + n * per, bs, dtype=dtype)
        cache.k.normal_()
        cache.v.normal_()
        ids = torch.randint(0, 200, (n, 1))
        last = torch.zeros(n, dtype=torch.long)
        for pos in args.positions:
            kv_bytes = n * cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * pos * cache.k.element_size()
            for layout in ("contiguous", "scattered"):
                rows = layouts[layout]

                def step():
                    with torch.inference_mode():
                        model(ids, CacheBatch.build(cache, rows, [pos] * n, 1, [0] * n), last=last)

                q = torch.randn(n, cfg.n_head, 1, cfg.head_dim, dtype=dtype)
                kv = torch.randn(n, cfg.n_kv_head, 1, cfg.head_dim, dtype=dtype)

                def attend():
                    with torch.inference_mode():
                        cb = CacheBatch.build(cache, rows, [pos] * n, 1, [0] * n)
                        attention.cache_attention(q, kv, kv, 0, cb, None)

                s, a = timed(step, args.repeats), timed(attend, args.repeats)
                row = {"dtype": name, "position": pos, "layout": layout, "step_ms": 1000 * s,
                       "step_gbps": kv_bytes / s / 1e9, "attention_ms": 1000 * a,
                       "attention_gbps": kv_bytes / cfg.n_layer / a / 1e9}
                out.append(row)
                print(f"{name:>9}{pos:9}{layout:>11}{row['step_ms']:9.2f}{row['step_gbps']:7.1f}"
                      f"{row['attention_ms']:9.3f}{row['attention_gbps']:7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor(), "args": vars(args),
                       "rows": out}, f, indent=2)


if __name__ == "__main__":
    main()
