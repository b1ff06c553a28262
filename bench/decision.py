"""Decision benchmark: 64 requests of 3 questions through decide_batch vs a loop of decide.

    python -m bench.decision [--json out.json] [--hidden 64] [--max-batch-tokens 4096] [--layers 4]
                             [--device cpu|cuda] [--dtype fp32|bf16]

A Qwen3.5 hybrid model (Gated DeltaNet + full attention) with random weights, small by default (fp32 on this
CPU). On CUDA the loop of `decide` replays CUDA graphs and `decide_batch` runs eager batched passes; the
fast kernels are flash-linear-attention's (the `gpu` extra), STARTLUX_ALLOW_SLOW=1 without causal-conv1d.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time

import torch

from core.decision import StartLuxDecision
from core.decision.checkpoint import (hybrid_text_config, new_hybrid_model, save_decision_checkpoint,
                                      train_decision_tokenizer)

WORDS = "the cat dog red blue green is are what which how many apple pear plum city river".split()


def make_requests(n: int, seed: int = 0):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        state = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60)))
        reqs.append((state, {
            "color": {"instructions": "which color", "criteria": {"r": "red", "g": "green", "b": "blue"}},
            "cat": {"type": "noul", "instructions": "is there a cat"},
            "many": {"type": "score", "instructions": "how many animals", "criteria": ["none", "one", "several"]},
        }))
    return reqs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(2000)]
    tok = train_decision_tokenizer(texts, 2048)
    cfg = hybrid_text_config(len(tok), hidden=args.hidden, layers=args.layers, heads=args.heads,
                             pad_token_id=tok.pad_token_id)
    with tempfile.TemporaryDirectory() as d:
        save_decision_checkpoint(d, new_hybrid_model(cfg), tok)
        scorer = StartLuxDecision(d, device=args.device, max_batch_tokens=args.max_batch_tokens, dtype=dtype)
        reqs = make_requests(args.requests)
        scorer.decide_batch(reqs[:4])           # warm-up
        scorer.decide(*reqs[0])
        batched, looped = float("inf"), float("inf")
        for _ in range(args.repeats):            # best of N: this 2-core machine is noisy
            t0 = time.perf_counter()
            scorer.decide_batch(reqs)
            batched = min(batched, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for state, qs in reqs:
                scorer.decide(state, qs)
            looped = min(looped, time.perf_counter() - t0)
    n_q = 3 * len(reqs)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{platform.machine()} {torch.get_num_threads()} threads"
    result = {"machine": f"{device}, torch {torch.__version__}",
              "model": f"qwen3_5 hybrid {args.layers} layers x {args.hidden}, {args.heads} heads "
                       f"(3 linear : 1 full), {args.dtype} {args.device}",
              "questions": n_q, "max_batch_tokens": args.max_batch_tokens, "decide_batch_qps": n_q / batched,
              "decide_loop_qps": n_q / looped, "speedup": looped / batched}
    print(f"{'':22}{'questions/s':>12}{'seconds':>10}")
    print(f"{'decide_batch':22}{result['decide_batch_qps']:12.1f}{batched:10.2f}")
    print(f"{'loop of decide':22}{result['decide_loop_qps']:12.1f}{looped:10.2f}")
    print(f"speedup: {result['speedup']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
