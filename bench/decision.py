"""Decision benchmark: a workload shaped like System One clients, through the scorer's paths and a peer.

    python -m bench.decision [--checkpoint models/demo-decision | --random --hidden 64 --layers 4 --heads 4]
                             [--requests 48] [--max-batch-tokens 4096] [--device cpu|cuda] [--dtype fp32|bf16]
                             [--no-pipeline] [--json out.json]

The workload (`client_workload`): JSON states of about 200 to 2,000 tokens (a ticket with its history, a page
with its elements, a board), 1 to 8 questions per request, a tournament (a choice over more options than the
model shows at once) in about one request in eight, and a quarter of the requests about a state sent before.

Run side by side on the same checkpoint, in one process:
- `full prompts`: every question's whole prompt, the seed's way (`share_prefix=False`);
- `state once`: the state block once per request, tails from its cache (prefix cache off);
- `state once + cache`: the same with the prefix cache across requests (the service's default);
- transformers' `DecisionPipeline` on the same weights, one prompt per forward pass (its own prompt format,
  its generic template through a plain chat template: compare speed only).
Each scorer path runs as a loop of `decide` and as `decide_batch` over batches of 16 (the deployment's batch
size). Then one request with 1 and with 8 questions over a 1,000-token state, prefix cache off.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from core.decision import StartLuxDecision

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the cat dog red blue green apple pear plum city river bus drill tiger hammer office opens nine "
         "photo upload crash payment refund login page button cart checkout").split()
BATCH = 16
CHEAP_WORDS = "the a red blue green cat dog box door light room open closed small big left right near far".split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def client_state(rng: random.Random, approx_tokens: int, count=None):
    """A JSON state of roughly `approx_tokens` tokens (as `count(json_text)` counts them), in one of three shapes
    clients send."""
    shape = rng.randrange(3)
    seed = rng.random()
    n = max(1, approx_tokens // 12)
    if count is not None:            # size the state by the tokenizer's count: twice, the second from the first
        for _ in range(2):
            got = count(json.dumps(_state(random.Random(seed), shape, n), indent=2))
            n = max(1, round(n * approx_tokens / got))
    return _state(random.Random(seed), shape, n)


def _state(rng: random.Random, shape: int, n: int):
    if shape == 0:
        return {"ticket": {"id": rng.randint(1000, 9999), "subject": words(rng, 6),
                           "history": [{"from": rng.choice(["user", "agent"]), "text": words(rng, 8)}
                                       for _ in range(n)]}}
    if shape == 1:
        return {"url": "https://shop.example/cart", "title": words(rng, 4),
                "elements": [{"id": i, "tag": rng.choice(["a", "button", "input"]), "text": words(rng, 5)}
                             for i in range(n)]}
    return {"board": [[rng.choice(["X", "O", ""]) for _ in range(8)] for _ in range(max(1, n // 3))],
            "moves": [words(rng, 3) for _ in range(n)], "to_move": "X"}


def client_questions(rng: random.Random, n: int, tournament: bool) -> dict:
    qs = {}
    for i in range(n):
        kind = rng.choice(["choice", "noul", "score"])
        if kind == "choice":
            qs[f"q{i}"] = {"type": "choice", "instructions": f"Which fits best: {words(rng, 5)}?",
                           "criteria": {f"o{j}": words(rng, 3) for j in range(rng.randint(2, 5))}}
        elif kind == "noul":
            qs[f"q{i}"] = {"type": "noul", "instructions": {"check": words(rng, 5), "rules": [words(rng, 4)]}}
        else:
            qs[f"q{i}"] = {"type": "score", "instructions": f"How much {words(rng, 3)}?",
                           "criteria": ["none", "a little", "some", "a lot"]}
    if tournament:
        qs["pick"] = {"type": "choice", "instructions": "Which element should be clicked?",
                      "criteria": {f"e{j}": words(rng, 2) for j in range(12)}}
    return qs


def client_workload(n: int, seed: int = 0, count=None) -> list[dict]:
    """n System One requests (see the module's docstring); `count` sizes the states in tokens."""
    rng = random.Random(seed)
    out: list[dict] = []
    for _ in range(n):
        state = (rng.choice(out)["state"] if out and rng.random() < 0.25
                 else client_state(rng, rng.randint(200, 2000), count))
        out.append({"state": state, "questions": client_questions(rng, rng.randint(1, 8), rng.random() < 0.125)})
    return out


def cheap_workload(n: int, seed: int) -> list[dict]:
    """n small requests: 3 questions over a state of 8-40 words, about half of the states repeated."""
    rng = random.Random(seed)
    states: list[str] = []
    out = []
    for _ in range(n):
        if states and rng.random() < 0.5:
            state = rng.choice(states)
        else:
            state = " ".join(rng.choice(CHEAP_WORDS) for _ in range(rng.randint(8, 40)))
            states.append(state)
        out.append({"state": state, "questions": {
            "color": {"instructions": "which color is the cat", "criteria": {"r": "red", "b": "blue", "g": "green"}},
            "open": {"type": "noul", "instructions": "is the door open"},
            "size": {"type": "score", "instructions": "how big is the room", "criteria": ["small", "medium", "big"]}}})
    return out


def count_questions(reqs: list[dict]) -> int:
    return sum(len(r["questions"]) for r in reqs)


def time_loop(scorer, reqs) -> float:
    t0 = time.perf_counter()
    for r in reqs:
        scorer.decide(r["state"], r["questions"])
    return time.perf_counter() - t0


def time_batches(scorer, reqs) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(reqs), BATCH):
        scorer.decide_batch([(r["state"], r["questions"]) for r in reqs[i:i + BATCH]])
    return time.perf_counter() - t0


def pipeline_seconds(path: str, reqs: list[dict], device: str, dtype) -> float:
    """transformers' DecisionPipeline over the same weights (its generic decision prompt as the only message of a
    plain chat template; single-character labels, which this tokenizer holds as single tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DecisionConfig, pipeline

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{{ messages[0]['content'] }}"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    config = DecisionConfig(labels={"noul": ["Y", "N"]})
    pipe = pipeline("decision", model=model, tokenizer=tok, decision_config=config, device=model.device)
    pipe(reqs[0])
    t0 = time.perf_counter()
    for r in reqs:
        pipe({"state": r["state"], "questions": r["questions"]})
    return time.perf_counter() - t0


def random_checkpoint(d: str, hidden: int, layers: int, heads: int) -> str:
    from core.decision.build import (hybrid_text_config, new_hybrid_model, save_decision_checkpoint,
                                          train_decision_tokenizer)

    rng = random.Random(0)
    tok = train_decision_tokenizer([words(rng, 12) for _ in range(2000)], 2048)
    cfg = hybrid_text_config(len(tok), hidden=hidden, layers=layers, heads=heads, pad_token_id=tok.pad_token_id)
    save_decision_checkpoint(d, new_hybrid_model(cfg), tok)
    return d


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--checkpoint", default=str(ROOT / "models" / "demo-decision"))
    p.add_argument("--random", action="store_true", help="a random-weight model of --hidden/--layers/--heads")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--no-pipeline", action="store_true", help="skip transformers' DecisionPipeline")
    args = p.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    with tempfile.TemporaryDirectory() as d:
        path = random_checkpoint(d, args.hidden, args.layers, args.heads) if args.random else args.checkpoint
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        count = lambda text: len(tok.encode(text, add_special_tokens=False))   # noqa: E731
        reqs = client_workload(args.requests, count=count)
        n_q = count_questions(reqs)
        kw = dict(device=args.device, max_batch_tokens=args.max_batch_tokens, dtype=dtype)
        paths = {"full prompts": dict(share_prefix=False, prefix_cache_mb=0),
                 "state once": dict(prefix_cache_mb=0),
                 "state once + cache": {}}
        rows = {}
        for name, extra in paths.items():
            warm = StartLuxDecision(path, **kw, **extra)
            warm.decide(reqs[0]["state"], reqs[0]["questions"])
            loop_s = time_loop(StartLuxDecision(path, **kw, **extra), reqs)    # fresh: an empty prefix cache
            batch_s = time_batches(StartLuxDecision(path, **kw, **extra), reqs)
            rows[name] = {"loop_qps": n_q / loop_s, "batch_qps": n_q / batch_s}
            print(f"{name:22} loop {n_q / loop_s:8.1f} q/s   decide_batch {n_q / batch_s:8.1f} q/s", flush=True)
        if not args.no_pipeline:
            s = pipeline_seconds(path, reqs, args.device, dtype)
            rows["DecisionPipeline"] = {"loop_qps": n_q / s}
            print(f"{'DecisionPipeline':22} loop {n_q / s:8.1f} q/s", flush=True)
        # one request, 1 and 8 questions, over a ~1,000-token state, state once without the cache
        scorer = StartLuxDecision(path, **kw, prefix_cache_mb=0)
        rng = random.Random(1)
        state = client_state(rng, 1000, count)
        eight = client_questions(rng, 8, tournament=False)
        one = dict(list(eight.items())[:1])
        scorer.decide(state, one)
        t1 = min(time_loop(scorer, [{"state": state, "questions": one}]) for _ in range(5))
        t8 = min(time_loop(scorer, [{"state": state, "questions": eight}]) for _ in range(5))
        state_tokens = len(scorer.prepare(scorer.parse(state, one)).prefix)
        tokens = sum(len(scorer.prepare(scorer.parse(r["state"], r["questions"])).prefix) for r in reqs) / len(reqs)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{platform.machine()} {torch.get_num_threads()} threads"
    model = (f"random qwen3_5 hybrid {args.layers} layers x {args.hidden}, {args.heads} heads" if args.random
             else Path(args.checkpoint).name)
    result = {"machine": f"{device}, torch {torch.__version__}", "model": f"{model}, {args.dtype} {args.device}",
              "requests": len(reqs), "questions": n_q, "mean_state_tokens": tokens,
              "max_batch_tokens": args.max_batch_tokens, "paths": rows,
              "one_vs_eight": {"state_tokens": state_tokens, "one_s": t1, "eight_s": t8, "ratio": t8 / t1}}
    print(f"{len(reqs)} requests, {n_q} questions, states of {tokens:.0f} tokens on average")
    print(f"8 questions / 1 question over a {state_tokens}-token state: {t8 * 1e3:.0f} / {t1 * 1e3:.0f} ms "
          f"= {t8 / t1:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
