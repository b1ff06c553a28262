"""What one `decide_batch` costs on a device, by batch shape: the figures the synthetic scorer replays.

    python -m bench.decision_batches [--checkpoint models/demo-decision] [--device cuda] [--sizes 1 2 4 8 16 32]
                                     [--repeats 5] [--tail-graphs both] [--json out.json]

For each workload and batch size, `--repeats` batches of fresh requests (a new seed each: the prefix cache
misses, as for a new state) after one warm-up batch of that shape, and the same batches again (every state
now in the prefix cache: the repeat half of the cheap workload). Workloads: `cheap` (bench.decision_path's
requests: a state of 8-40 words and 3 questions) and `client` (bench.decision's client-shaped requests).
A batch of one goes through `decide` (on CUDA, its recorded graphs), as the deployment's batches of one do.
With `--tail-graphs both` (on CUDA) every shape also runs with the state-once passes eager (no tail graphs),
on batches of its own seeds, alternating with the graphed ones: the tail graphs' before/after.
Prints each shape's median wall time, the prompt tokens computed (not from the cache), and a least-squares fit
`seconds = a + b * requests + c * computed tokens` over all shapes: the synthetic scorer's model
(core/decision/synthetic.py) takes its constants from this fit.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.decision import cheap_workload, client_workload
from core.decision import StartLuxDecision

ROOT = Path(__file__).resolve().parent.parent


def timed(scorer, batch: list[dict], device: str) -> tuple[float, int, int]:
    """One batch: seconds, prompt tokens, cached tokens."""
    pairs = [(r["state"], r["questions"]) for r in batch]
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = scorer.decide_batch(pairs, with_usage=True)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(u["input_tokens"] for _, u in out)
    cached = sum(u["input_tokens_details"]["cached_tokens"] for _, u in out)
    return seconds, tokens, cached


def fit(rows: list[dict]) -> dict:
    """Least squares of seconds on (1, requests, computed tokens)."""
    x = torch.tensor([[1.0, r["requests"], r["computed_tokens"]] for r in rows], dtype=torch.float64)
    y = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1).tolist()
    return {"pass_s": coef[0], "per_request_s": coef[1], "per_token_s": coef[2]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", default=str(ROOT / "models" / "demo-decision"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--client-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-batch-tokens", type=int, default=65536)
    p.add_argument("--tail-graphs", choices=["on", "both"], default="on",
                   help="both: also time every shape with the state-once passes eager, alternating")
    p.add_argument("--json")
    a = p.parse_args()
    scorer = StartLuxDecision(a.checkpoint, device=a.device, max_batch_tokens=a.max_batch_tokens)
    recorded = scorer.tail_graphs
    variants = [True, False] if a.tail_graphs == "both" and recorded is not None else [recorded is not None]
    rows: list[dict] = []
    seed = 1000
    for workload, sizes in (("cheap", a.sizes), ("client", a.client_sizes)):
        for n in sizes:
            make = cheap_workload if workload == "cheap" else client_workload
            batches: dict[bool, list] = {}
            for v in variants:
                scorer.tail_graphs = recorded if v else None
                seed += 1
                timed(scorer, make(n, seed), a.device)               # warm-up: this shape's kernels
                batches[v] = []
                for _ in range(a.repeats):
                    seed += 1
                    batches[v].append(make(n, seed))
            for phase in ("miss", "hit"):
                got: dict[bool, list] = {v: [] for v in variants}
                for i in range(a.repeats):                           # the variants alternate batch by batch
                    for v in variants:
                        scorer.tail_graphs = recorded if v else None
                        got[v].append(timed(scorer, batches[v][i], a.device))
                for v in variants:
                    secs = statistics.median(g[0] for g in got[v])
                    tokens = statistics.median(g[1] for g in got[v])
                    computed = statistics.median(g[1] - g[2] for g in got[v])
                    questions = sum(len(r["questions"]) for r in batches[v][0])
                    row = {"workload": workload, "requests": n, "phase": phase, "questions": questions,
                           "tail_graphs": v, "seconds": secs, "tokens": tokens, "computed_tokens": computed}
                    rows.append(row)
                    print(f"{workload:6} n={n:3} {phase:4} tail graphs {'on ' if v else 'off'}: "
                          f"{secs * 1e3:8.2f} ms  {questions / secs:8.0f} q/s  tokens {tokens:7.0f} "
                          f"computed {computed:7.0f}", flush=True)
    scorer.tail_graphs = recorded
    model = fit([r for r in rows if r["tail_graphs"] == variants[0]])
    print("fit:", json.dumps(model))
    info = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device, "torch": torch.__version__,
            "kernels": scorer.kernels, "checkpoint": a.checkpoint}
    if a.json:
        Path(a.json).write_text(json.dumps({"info": info, "rows": rows, "fit": model}, indent=1))


if __name__ == "__main__":
    main()
