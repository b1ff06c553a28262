"""The decision scorer alone under the soak's decision mix: does its memory grow once the prefix cache is full?

    python -m bench.decision_memory [--requests 20000] [--cache-mb 32] [--sample 500] [--trim-every 0]
                                    [--threads 1] [--json out.json]

The soak (bench/soak.py) saw the decision process grow by about 44 MB an hour after its prefix cache had
reached its limit. This runs the demo decision checkpoint's scorer in this process, with no service around it,
on the soak's decision bodies (half on 8 recurring long states, half fresh short ones) in batches of 1 to 16,
and reads this process's resident memory every --sample requests, with glibc's own account of its heap
(`mallinfo2`: bytes in use by live allocations, free inside the heap, mmapped) and the prefix cache's entries
and key bytes. At the end it calls glibc's `malloc_trim(0)` and reads it again: memory that the trim gives
back was free inside the allocator (freed by the scorer but kept by malloc's arenas), memory that stays is
held by something. --trim-every N trims after every N requests instead, as the service's decision process
does every 30 s. Set MALLOC_ARENA_MAX or MALLOC_MMAP_THRESHOLD_ in the environment to try the allocator's
settings.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from bench.soak import decision_body, slope
from core.child import ROOT
from core.decision.memory import MemoryReturn, resident_kb
from core.decision import DecisionConfig, StartLuxDecision

CHECKPOINT = os.path.join(ROOT, "models", "demo-decision")


def rss_mb() -> float:
    return resident_kb() / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--cache-mb", type=float, default=32)
    ap.add_argument("--sample", type=int, default=500)
    ap.add_argument("--trim-every", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    scorer = StartLuxDecision(CHECKPOINT, DecisionConfig(prefix_cache_mb=args.cache_mb, max_batch_tokens=4096))
    rng, memory = random.Random(args.seed), MemoryReturn(0)
    samples, heaps, full_at, done, t0 = [(0, rss_mb())], [], None, 0, time.monotonic()
    while done < args.requests:
        n = min(rng.randint(1, 16), args.requests - done)
        batch = [(b["state"], b["questions"]) for b in (decision_body(rng) for _ in range(n))]
        scorer.decide_batch(batch)
        before, done = done, done + n
        if args.trim_every and done // args.trim_every > before // args.trim_every:
            memory.trim()
        if done // args.sample > before // args.sample:
            stats = scorer.prefix_cache.stats()
            if full_at is None and stats["bytes"] > 0.9 * stats["capacity_bytes"]:
                full_at = done
            samples.append((done, rss_mb()))
            heap = memory.heap() or {}
            keys = sum(sys.getsizeof(k) + sum(sys.getsizeof(i) for i in k if i > 256)
                       for k in list(scorer.prefix_cache._entries))
            heaps.append({"requests": done, "rss_mb": samples[-1][1], "key_mb": keys / 2**20, **stats,
                          **{k: v / 2**20 for k, v in heap.items()}})
            print(f"{done:>7} requests  rss {samples[-1][1]:7.1f} MB  cache {stats['bytes'] / 2**20:6.1f} MB "
                  f"{stats['entries']:>5} entries  keys {keys / 2**20:5.1f} MB  "
                  + "  ".join(f"{k} {v / 2**20:7.1f}" for k, v in heap.items())
                  + f"  {time.monotonic() - t0:6.0f} s", flush=True)
    after_full = [s for s in samples if full_at is not None and s[0] >= full_at]
    end = rss_mb()
    memory.trim()
    trimmed = rss_mb()
    result = {"requests": done, "cache_mb": args.cache_mb, "trim_every": args.trim_every,
              "env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
              "cache_full_at": full_at, "rss_when_full_mb": after_full[0][1] if after_full else None,
              "rss_end_mb": end, "rss_after_trim_mb": trimmed,
              "mb_per_1000_after_full": 1000 * slope(after_full), "samples": samples, "heaps": heaps}
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "heaps")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
