"""One user at a time: the chat engine's time per output token at one (and a few) streams, by weight format (#55).

    python -m bench.single_stream [--shape 12x768] [--streams 1] [--threads 1 2] [--rounds 3]
                                  [--variants bf16 bf16-before int8 fp32] [--json out.json]
    python -m bench.single_stream --fidelity [--model DIR] [--prompts 64]
    python -m bench.single_stream --model models/demo-chat --variants fp32 fp32-modules [--streams 1 4]

The model is bench.vllm_peer's random GPT-2 (`--shape` layers x width, the demo vocabulary of 2,048), as #55's
table measures it, or a checkpoint (`--model`): each stream a 64-token prompt and 128 new tokens, greedy, `ignore_eos`, the engine alone
(no HTTP). Variants, each on its own copy of the same weights, alternating within every round:

- `bf16`: the engine's default on a CPU with native bf16 (packed linear layers, the small-row kernel at one or
  two rows; core/chat/small_linear.py);
- `int8`: `weights: int8` (core/chat/quantized.py) on the bf16 model;
- `fp32`: fp32 weights (the engine's default where the CPU has no native bf16);
- `int8-fp32`: int8 weights with fp32 activations (`weights: int8` where the CPU has no native bf16);
- `*-before`: `small_row_kernel` off (oneDNN's and MKL's products at every row count, the blocks as modules);
- `*-modules`: `fused_decode` off: the small-row kernel's products, the blocks run module by module instead of
  core/chat/decode_stack.py's one call.

TPOT is the mean time of the decode steps after the first token (each step makes one token a stream), best of
`--rounds`; TTFT the prefill step's time. Thread counts run in turn, each in this process with torch's intra-op
threads set for it.

`--fidelity`: what int8 weights change, on the random GPT-2 or a checkpoint (`--model`), against the same
model in bf16, beside what fp32 changes against bf16 (the rounding users already accept): the logits of a plain pass over `--prompts` prompts (largest difference, and as a share of the
logits' spread; the top token per position), and greedy generation (32 tokens a prompt: the share of sequences
identical, and of tokens before the first difference).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from bench.vllm_peer import random_gpt2
from core.chat import LLMEngine, SamplingParams

VARIANTS = {
    "bf16": (torch.bfloat16, dict()),
    "bf16-before": (torch.bfloat16, dict(small_row_kernel=False)),
    "int8": (torch.bfloat16, dict(weights="int8")),
    "int8-fp32": (torch.float32, dict(weights="int8")),     # int8 weights, fp32 activations (chat_dtype auto on AVX2)
    "fp32": (torch.float32, dict()),
    "fp32-before": (torch.float32, dict(small_row_kernel=False)),
    # the blocks as modules, one torch op at a time, instead of core/chat/decode_stack.py's one call
    "bf16-modules": (torch.bfloat16, dict(fused_decode=False)),
    "int8-modules": (torch.bfloat16, dict(weights="int8", fused_decode=False)),
    "int8-fp32-modules": (torch.float32, dict(weights="int8", fused_decode=False)),
    "fp32-modules": (torch.float32, dict(fused_decode=False)),
}


def engine_for(shape: tuple[int, int], variant: str, streams: int, model_dir: str | None = None) -> LLMEngine:
    """The variant's engine on the random GPT-2 of `shape`, or on the checkpoint in `model_dir`."""
    dtype, settings = VARIANTS[variant]
    if model_dir:
        from core.chat import load_chat_model

        model, tok, _ = load_chat_model(model_dir, device="cpu", dtype=dtype)
    else:
        model, tok = random_gpt2(*shape)
    return LLMEngine(model.to(dtype), tok, max_rows=max(8, streams), **settings)


def one_run(engine: LLMEngine, streams: int, prompt: int, new: int, seed: int) -> tuple[float, float]:
    """-> (TTFT: the first step's seconds, TPOT: mean seconds of the later steps)."""
    rng = random.Random(seed)
    for i in range(streams):
        engine.add_request([rng.randrange(3, 2000) for _ in range(prompt)],
                           SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), f"s{seed}-{i}")
    steps = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return steps[0], sum(steps[1:]) / max(1, len(steps) - 1)


def fidelity(model_dir: str | None, shape: tuple[int, int], n: int) -> list[dict]:
    """int8 weights against bf16, and for scale fp32 against bf16, on the same prompts."""
    from core.chat import load_chat_model
    from core.chat.quantized import quantize_linears

    def load(dtype):
        if model_dir:
            model, tok, _ = load_chat_model(model_dir, device="cpu", dtype=dtype)
            return model, tok
        model, tok = random_gpt2(*shape)
        return model.to(dtype), tok

    base, tok = load(torch.bfloat16)
    int8, fp32 = load(torch.bfloat16)[0], load(torch.float32)[0]
    quantize_linears(int8)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, tok.vocab_size, (int(torch.randint(8, 64, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]

    def generate(model):
        engine = LLMEngine(model, tok, max_rows=16)
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), f"p{i}")
        got = {}
        while engine.has_work():
            for ev in engine.step():
                if ev.token is not None:
                    got.setdefault(ev.request_id, []).append(ev.token)
        return [got[f"p{i}"] for i in range(n)]

    reference = generate(base)
    out = []
    for name, other in (("int8", int8), ("fp32", fp32)):
        worst = spread = top = positions = 0.0
        with torch.no_grad():
            for p in prompts:
                a, b = base(torch.tensor([p]))[0], other(torch.tensor([p]))[0]
                worst = max(worst, (a - b).abs().max().item())
                spread = max(spread, (a.max(-1).values - a.min(-1).values).max().item())
                top += (a.argmax(-1) == b.argmax(-1)).sum().item()
                positions += len(p)
        theirs = generate(other)
        first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(reference, theirs)]
        row = {"model": model_dir or f"random GPT-2 {shape[0]}x{shape[1]}", "against bf16": name, "prompts": n,
               "max_abs_logit_diff": round(worst, 4), "of_logit_spread": round(worst / spread, 4),
               "top1_agreement": round(top / positions, 4),
               "greedy_identical": round(sum(f == len(s) for f, s in zip(first, reference)) / n, 3),
               "greedy_token_agreement": round(sum(first) / sum(len(s) for s in reference), 3)}
        print(json.dumps(row))
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="12x768", help="LAYERSxWIDTH of the random GPT-2")
    p.add_argument("--streams", type=int, nargs="+", default=[1])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fidelity", action="store_true", help="instead: int8 against bf16 (logits, greedy)")
    p.add_argument("--model", help="a checkpoint directory instead of the random GPT-2 (prompts of random ids "
                                   "below 2,000)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args()
    shape = tuple(int(v) for v in args.shape.lower().split("x"))
    if args.fidelity:
        fidelity(args.model, shape, args.prompts)
        return
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.model or 'GPT-2 ' + args.shape}, {args.prompt}-token prompts, {args.new} new tokens")
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for streams in args.streams:
            engines = {v: engine_for(shape, v, streams, args.model) for v in args.variants}
            for engine in engines.values():
                one_run(engine, streams, args.prompt, 8, seed=0)                 # warm up
            runs = {v: [] for v in engines}
            for r in range(args.rounds):                                         # alternating
                for v, engine in engines.items():
                    runs[v].append(one_run(engine, streams, args.prompt, args.new, seed=r + 1))
            for v, got in runs.items():
                ttft, tpot = min(t for t, _ in got), min(t for _, t in got)
                results.append({"variant": v, "threads": threads, "streams": streams, "tpot_ms": round(tpot * 1e3, 2),
                                "ttft_ms": round(ttft * 1e3, 1), "tpot_runs_ms": [round(t * 1e3, 2) for _, t in got]})
                print(f"{threads} thread(s), {streams} stream(s), {v:<12} TPOT {tpot * 1e3:6.2f} ms "
                      f"(runs {', '.join(f'{t * 1e3:.2f}' for _, t in got)}), TTFT {ttft * 1e3:.1f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape,
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
