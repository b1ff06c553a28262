"""Ways for the chat engine to use a second core, alone and beside work that wakes often (#53).

    python -m bench.engine_threads [--workloads random-768 random-64] [--modes 1 2 split attn2 engines]
                                   [--passive both|on|off] [--competitor none 0 19] [--shape 4x256] [--rounds 1]
                                   [--attention-source FILE]

On the service's two cores the engine shares the machine with the serving processes, which wake hundreds of
times a second for a few hundred microseconds each. This runs the engine alone (bench.vllm_peer's random GPT-2
in bf16, `workload`'s 96 prompts, 32 rows, 64 greedy tokens each, `ignore_eos`, prefill chunk 512 as the CPU
config) in a child process per variant, so that each variant starts from a fresh OpenMP runtime:

- `1`: one torch thread (the CPU config);
- `2`: two torch threads (OpenMP: every operation split over both, a barrier at its end);
- `split`: two threads for prefill passes, one for decode passes;
- `attn2`: two threads for attention alone (`chat_attention_threads: 2`), one for the rest;
- `engines`: two engines of 16 rows each on two Python threads of one process, one torch thread each (no
  barrier between them, one interpreter lock).

`--passive`: each variant also (or only) with `OMP_WAIT_POLICY=PASSIVE` (idle OpenMP threads sleep at once
instead of spinning). `--competitor NICE`: while the engine runs, two processes at that nice value each wake
every 1.0 / 1.3 ms and compute for 0.2 ms (about a third of a core together: a stand-in for the serving
processes' wakes). `--attention-source FILE`: the decode attention kernel built from FILE instead of
core/chat/csrc/cache_attention.cpp (an earlier version, `git show REV:core/chat/csrc/cache_attention.cpp`), for
a before/after comparison in one run: each variant runs with both, alternating. Prints tokens/s and the
engine's CPU per wall second.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMPETITOR = """
import os, sys, time
os.nice(int(sys.argv[1]))
period = float(sys.argv[2])
while True:
    time.sleep(period)
    t = time.perf_counter()
    while time.perf_counter() - t < 0.0002:
        pass
"""


def child(checkpoint: str, workload: str, mode: str, attention_source: str = "") -> None:
    """One variant in this process: prints RESULT and its figures as JSON."""
    import threading

    import torch

    if attention_source:
        from core.chat import attention
        from core.chat.extensions import extension

        other = extension("bench_cache_attention_other", os.path.abspath(attention_source), "")
        attention.kernel = lambda: other

    from bench.vllm_peer import greedy, workload_prompts
    from core.chat import LLMEngine
    from core.chat.weights import chat_dtype, load_chat_model

    torch.set_num_threads(2 if mode == "2" else 1)
    model, tok, _ = load_chat_model(checkpoint, "cpu", chat_dtype("auto", torch.device("cpu"))[0])
    engines = [LLMEngine(model, tok, max_rows=16 if mode == "engines" else 32, prefill_chunk=512,
                         attention_threads=2 if mode == "attn2" else None)
               for _ in range(2 if mode == "engines" else 1)]
    if mode == "split":
        prefill = engines[0]._prefill

        def two_threads(batch, events):
            torch.set_num_threads(2)
            try:
                prefill(batch, events)
            finally:
                torch.set_num_threads(1)
        engines[0]._prefill = two_threads
    for e in engines:
        greedy(e, [[tok.bos_id, 5, 6, 7]] * 4, 8, "warm")
    ids = workload_prompts(workload, min(tok.vocab_size, tok.bos_id), tok.bos_id)
    made = [0] * len(engines)

    def run(i: int) -> None:
        torch.set_num_threads(2 if mode == "2" else 1)
        made[i] = greedy(engines[i], ids[i::len(engines)], 64, "r")

    t0, c0 = time.perf_counter(), time.process_time()
    if mode != "engines":
        run(0)           # on the main thread, as the engine process runs its engine (OpenMP's team differs)
    else:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(engines))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - t0
    print("RESULT " + json.dumps({"tokens_per_s": sum(made) / wall, "cpu_per_wall": (time.process_time() - c0) / wall}))


def variant(checkpoint: Path, workload: str, mode: str, passive: bool, competitor: str, source: str = "") -> dict:
    env = {**os.environ, **({"OMP_WAIT_POLICY": "PASSIVE"} if passive else {})}
    rivals = [] if competitor == "none" else [
        subprocess.Popen([sys.executable, "-c", COMPETITOR, competitor, period], start_new_session=True)
        for period in ("0.001", "0.0013")]
    try:
        code = "import sys; from bench.engine_threads import child; child(*sys.argv[1:])"
        out = subprocess.run([sys.executable, "-c", code, str(checkpoint), workload, mode, source], capture_output=True,
                             text=True, timeout=1800, cwd=ROOT, env=env, start_new_session=True)
    finally:
        for r in rivals:
            r.kill()
            r.wait()
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(out.stderr[-2000:])


def main() -> None:
    import tempfile

    from bench.vllm_peer import build_checkpoints

    p = argparse.ArgumentParser()
    p.add_argument("--workloads", nargs="+", default=["random-768", "random-64"])
    p.add_argument("--modes", nargs="+", default=["1", "2", "split", "engines"],
                   choices=("1", "2", "split", "attn2", "engines"))
    p.add_argument("--passive", default="both", choices=("both", "on", "off"))
    p.add_argument("--competitor", nargs="+", default=["none"], help="none, or the competing processes' nice value")
    p.add_argument("--shape", default="4x256")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--attention-source", type=Path, help="also run each variant with this decode attention kernel")
    p.add_argument("--json")
    args = p.parse_args()
    layers, width = (int(v) for v in args.shape.split("x"))
    passive = {"both": [False, True], "on": [True], "off": [False]}[args.passive]
    kernels = [""] + ([str(args.attention_source)] if args.attention_source else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_checkpoints(Path(tmp), layers, width)[0]
        for rnd in range(args.rounds):
            for workload in args.workloads:
                for competitor in args.competitor:
                    for mode in args.modes:
                        for pas in passive:
                            for kernel in kernels:
                                r = variant(checkpoint, workload, mode, pas, competitor, kernel)
                                rows.append({"round": rnd, "workload": workload, "competitor": competitor,
                                             "mode": mode, "passive": pas, "kernel": kernel or "this", **r})
                                print(f"{workload:12s} competitor {competitor:5s} {mode:8s} "
                                      f"{'passive' if pas else 'spin':8s} {(kernel and 'other') or 'this':6s}"
                                      f"{r['tokens_per_s']:8.0f} tokens/s  CPU/wall {r['cpu_per_wall']:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
