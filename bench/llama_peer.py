"""llama.cpp beside the chat engine at one stream, on the same weights (#55).

    python -m bench.llama_peer --llama-python /tmp/llama-venv/bin/python --llama-cpp DIR
                               [--shape 12x768] [--threads 1 2] [--rounds 3] [--json out.json]

llama.cpp is a peer here, never a dependency: `--llama-python` is the interpreter of a venv of its own with
`pip install llama-cpp-python==0.3.36` (it compiles llama.cpp: a few minutes); `--llama-cpp` the
`vendor/llama.cpp` folder of that release's source archive (`pip download --no-binary :all: --no-deps
llama-cpp-python==0.3.36`), whose `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/` convert a transformers
GPT-2 directory to GGUF. They are copied into the work folder and run by this project's interpreter (it has
torch and transformers); the copy's `get_vocab_base_pre` falls back to "gpt-2" for the demo vocabulary, whose
pre-tokenizer the converter does not know (prompts are token ids, so it does not matter), and the GPT-2
directory gets the `n_ctx` the converter reads. On a CPU with AMX, llama.cpp as pip builds it (`GGML_NATIVE`,
its AMX code on) stopped on the Q8_0 file with "Illegal instruction"; a build with AMX off runs it (the
`CMAKE_ARGS` are in bench/README.md, "One stream at the memory floor").

The model is bench.vllm_peer's random GPT-2 (`--shape`, the demo vocabulary of 2,048). Each round, alternating:
llama.cpp with the bf16, Q8_0 and f32 GGUF (one process per file and thread count, the model loaded once,
`generate` with top_k 1 from the token ids), then bench.single_stream's engines (bf16, bf16 with the
small-row kernel off, int8, fp32); each a 64-token prompt and 128 new tokens, TPOT = the time between the
first and the last token over 127, best of `--rounds`.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.single_stream import engine_for, one_run
from bench.vllm_peer import build_checkpoints

GGUF_TYPES = {"bf16": "bf16", "q8_0": "q8_0", "f32": "f32"}

# Runs in llama.cpp's venv: argv = gguf, threads, prompt tokens, new tokens, rounds; prints one JSON line a round.
CHILD = r"""
import json, random, sys, time
from llama_cpp import Llama
path, threads, prompt, new, rounds = sys.argv[1], *map(int, sys.argv[2:6])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512, verbose=False)
for r in range(rounds + 1):                      # round 0 warms up
    rng = random.Random(r)
    tokens = [rng.randrange(3, 2000) for _ in range(prompt)]
    t0 = time.perf_counter()
    stamps = []
    for tok in llm.generate(tokens, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == new:
            break
    if r:
        print(json.dumps({"ttft": stamps[0] - t0, "tpot": (stamps[-1] - stamps[0]) / (new - 1)}), flush=True)
"""


def convert(llama_cpp: Path, hf: Path, work: Path, types: list[str]) -> dict[str, Path]:
    """GGUF files of the transformers GPT-2 at `hf`, by the release's own converter -> type -> path."""
    conv = work / "conv"
    if conv.exists():
        shutil.rmtree(conv)
    conv.mkdir(parents=True)
    shutil.copy(llama_cpp / "convert_hf_to_gguf.py", conv)
    shutil.copytree(llama_cpp / "conversion", conv / "conversion")
    shutil.copytree(llama_cpp / "gguf-py", conv / "gguf-py")
    base = conv / "conversion" / "base.py"
    text = base.read_text()
    refusal = 'raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")'
    if refusal not in text:
        raise SystemExit(f"{base}: the converter's pre-tokenizer refusal was not found; another release?")
    base.write_text(text.replace(refusal, 'res = "gpt-2"'))
    config = json.loads((hf / "config.json").read_text())
    config["n_ctx"] = config["n_positions"]
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    out = {}
    for name in types:
        outtype = GGUF_TYPES[name]
        path = work / f"model-{name}.gguf"
        subprocess.run([sys.executable, str(conv / "convert_hf_to_gguf.py"), str(hf), "--outtype", outtype,
                        "--outfile", str(path)], check=True, capture_output=True,
                       env={"PYTHONPATH": str(conv / "gguf-py"), "PATH": "/usr/bin:/bin"})
        out[name] = path
    return out


def llama_round(python: str, gguf: Path, threads: int, prompt: int, new: int) -> tuple[float, float]:
    """One process, one timed round (after a warm-up round) -> (ttft, tpot) seconds."""
    done = subprocess.run([python, "-c", CHILD, str(gguf), str(threads), str(prompt), str(new), "1"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"llama.cpp failed on {gguf}:\n{done.stderr[-2000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return row["ttft"], row["tpot"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--llama-python", required=True)
    p.add_argument("--llama-cpp", required=True, type=Path, help="the release's vendor/llama.cpp folder")
    p.add_argument("--shape", default="12x768")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=["bf16", "bf16-before", "int8", "fp32"])
    p.add_argument("--gguf", nargs="+", default=list(GGUF_TYPES), choices=list(GGUF_TYPES),
                   help="the GGUF types llama.cpp runs")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--work", type=Path, help="keep the checkpoints and GGUF files here (default: a temporary folder)")
    p.add_argument("--json")
    args = p.parse_args()
    shape = tuple(int(v) for v in args.shape.lower().split("x"))
    work = args.work or Path(tempfile.mkdtemp(prefix="llama-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    _, hf, _, _ = build_checkpoints(work, *shape)
    ggufs = convert(args.llama_cpp, hf, work, args.gguf)
    version = subprocess.run([args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, llama-cpp-python {version}, "
          f"GPT-2 {args.shape}, {args.prompt}-token prompts, {args.new} new tokens")
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        engines = {v: engine_for(shape, v, 1) for v in args.variants}
        for engine in engines.values():
            one_run(engine, 1, args.prompt, 8, seed=0)
        runs: dict[str, list] = {**{f"llama.cpp {k}": [] for k in ggufs}, **{f"ours {v}": [] for v in engines}}
        for r in range(args.rounds):
            for k, path in ggufs.items():
                runs[f"llama.cpp {k}"].append(llama_round(args.llama_python, path, threads, args.prompt, args.new))
            for v, engine in engines.items():
                runs[f"ours {v}"].append(one_run(engine, 1, args.prompt, args.new, seed=r + 1))
        for name, got in runs.items():
            ttft, tpot = min(t for t, _ in got), min(t for _, t in got)
            results.append({"engine": name, "threads": threads, "tpot_ms": round(tpot * 1e3, 2),
                            "ttft_ms": round(ttft * 1e3, 1), "tpot_runs_ms": [round(t * 1e3, 2) for _, t in got]})
            print(f"{threads} thread(s) {name:<20} TPOT {tpot * 1e3:6.2f} ms (runs "
                  f"{', '.join(f'{t * 1e3:.2f}' for _, t in got)}), TTFT {ttft * 1e3:.1f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape,
                                               "llama_cpp_python": version, "results": results}, indent=2))


if __name__ == "__main__":
    main()
