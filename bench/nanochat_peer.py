"""Our engine beside nanochat's own `Engine`, on one checkpoint of nanochat's current architecture, the way
nanochat's `scripts/infer_bench.py` measures (that script needs CUDA; its method is reproduced here on a CPU).

    python -m bench.nanochat_peer --nanochat DIR [--shape 12x768] [--vocab 32768] [--sequence-len 2048]
                                  [--prompt 512] [--decode 64] [--batch-sizes 1 8 32] [--threads 1] [--json out.json]

DIR is nanochat's source (the directory holding the `nanochat` package), fetched by hand, never part of this
repository. A random model of nanochat's `GPT` (d-series heads of 128, `window_pattern` SSSL) is saved with
nanochat's `save_checkpoint` and converted with `core.chat.convert nanochat`; both engines then run the same
weights in fp32 on this CPU, in this process, with the same torch threads. As infer_bench does: one prompt of
`--prompt` tokens (its paragraph of text), a batch of B samples of it (nanochat: prefill once, copy the cache to
B rows; ours: `n=B`, which does the same), greedy, `--decode` tokens; TTFT is the first step (prefill and first
token), TPOT the median decode step, tokens/s B x steps over their sum. MBU: the bytes a decode step must read
(every parameter as stored, as infer_bench counts, plus B rows of keys and values at the middle context, cut to
each layer's window) per TPOT, over this machine's copy bandwidth measured here; "(matmul)" counts only the
products' weights (a step reads one row of each embedding table a token, not the tables), what a step really
moves. The special tokens' head rows
are zeroed so that no row stops early. Order per batch size: nanochat, ours, ours, nanochat; the better of each
pair is printed beside the other.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time

import torch

from bench.engine import random_vocab
from core.chat import LLMEngine, SamplingParams
from core.chat.convert import convert_nanochat
from core.chat.weights import load_chat_model
from tools.nanochat_reference import _randomize

PARAGRAPH = ("The history of science is the study of the development of science, including both the natural and "
             "social sciences. Science is a body of empirical, theoretical, and practical knowledge about the "
             "natural world. ")


def copy_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """Bytes per second this machine moves in a large tensor copy (read + write), on this process's threads."""
    a = torch.empty(int(gib * 2 ** 30) // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best


def kv_read_bytes(cfg, context: int, itemsize: int = 4) -> int:
    """Keys and values one row reads in a decode step at `context` positions (windowed layers: their window)."""
    per_pos = 2 * cfg.n_kv_head * cfg.head_dim * itemsize
    return sum(per_pos * min(context, w + 1 if w else context) for w in cfg.layer_windows)


def time_nanochat(engine, prompt: list[int], batch: int, decode: int) -> dict:
    gen = engine.generate(prompt, num_samples=batch, max_tokens=decode, temperature=0.0)
    t0 = time.perf_counter()
    next(gen)
    ttft = time.perf_counter() - t0
    steps = []
    while True:
        t0 = time.perf_counter()
        try:
            next(gen)
        except StopIteration:
            break
        steps.append(time.perf_counter() - t0)
    return {"ttft_s": ttft, "steps": steps}


def time_ours(model, tok, prompt: list[int], batch: int, decode: int) -> dict:
    engine = LLMEngine(model, tok, max_rows=batch, prefill_chunk=len(prompt), prefix_caching=False)
    engine.add_request(prompt, SamplingParams(n=batch, max_tokens=decode, temperature=0.0, ignore_eos=True), "r")
    t0 = time.perf_counter()
    engine.step()
    ttft = time.perf_counter() - t0
    steps = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return {"ttft_s": ttft, "steps": steps[:decode - 1]}    # the last step only retires the finished rows


def summary(run: dict, batch: int, read_bytes: float, matmul_bytes: float, bandwidth: float) -> dict:
    tpot = statistics.median(run["steps"])
    return {"ttft_ms": 1000 * run["ttft_s"], "tpot_ms": 1000 * tpot,
            "tokens_per_s": batch * len(run["steps"]) / sum(run["steps"]),
            "mbu_percent": 100 * read_bytes / tpot / bandwidth,
            "mbu_matmul_percent": 100 * matmul_bytes / tpot / bandwidth, "decode_steps": len(run["steps"])}


def build(src: str, root: str, n_layer: int, n_embd: int, vocab: int, sequence_len: int):
    """nanochat's GPT at this size with random weights, saved by nanochat and converted by us -> (nanochat model,
    nanochat tokenizer, our model, our tokenizer, our config)."""
    sys.path.insert(0, os.path.abspath(src))
    from nanochat import checkpoint_manager, gpt
    from nanochat.engine import Engine
    from nanochat.tokenizer import RustBPETokenizer

    tok = random_vocab(vocab)
    config = gpt.GPTConfig(sequence_len=sequence_len, vocab_size=tok.vocab_size, n_layer=n_layer,
                           n_head=n_embd // 128, n_kv_head=n_embd // 128, n_embd=n_embd, window_pattern="SSSL")
    model = gpt.GPT(config)
    model.init_weights()
    _randomize(model, seed=1)
    with torch.no_grad():
        model.lm_head.weight[min(tok.special_tokens.values()):] = 0.0
    ckpt = os.path.join(root, "nanochat")
    checkpoint_manager.save_checkpoint(ckpt, 0, model.state_dict(), None,
                                       {"model_config": dataclasses.asdict(config), "step": 0})
    with open(os.path.join(ckpt, "tokenizer.pkl"), "wb") as f:
        pickle.dump(tok.enc, f)
    convert_nanochat(ckpt, os.path.join(root, "ours"))
    ours, our_tok, cfg = load_chat_model(os.path.join(root, "ours"), device="cpu")
    return Engine(model.eval(), RustBPETokenizer(tok.enc, "<|bos|>")), model, ours, our_tok, cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanochat", required=True, help="nanochat's source (the directory with the nanochat package)")
    p.add_argument("--shape", default="12x768")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--sequence-len", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n_layer, n_embd = map(int, args.shape.split("x"))
    with tempfile.TemporaryDirectory() as root, torch.inference_mode():
        engine, theirs, ours, tok, cfg = build(args.nanochat, root, n_layer, n_embd, args.vocab, args.sequence_len)
        prompt = ([tok.bos_id] + tok.encode(PARAGRAPH * (args.prompt // 10)))[:args.prompt]
        weights = sum(t.numel() * t.element_size() for t in theirs.parameters())
        # what a decode step really reads of them: the products' weights (nanochat's num_matmul_params), not the
        # embedding tables, of which it reads one row a token
        matmul = sum(m.weight.numel() * m.weight.element_size() for m in theirs.modules()
                     if isinstance(m, torch.nn.Linear))
        context = args.prompt + args.decode // 2
        bandwidth = copy_bandwidth()
        print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s); "
              f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; {args.shape}, vocab {tok.vocab_size}, context "
              f"{args.sequence_len}, windows {cfg.layer_windows}; weights {weights / 2 ** 20:.0f} MiB; KV read "
              f"{kv_read_bytes(cfg, context) / 2 ** 10:.0f} KiB a row a step at {context}")
        time_nanochat(engine, prompt, 1, 4)                       # warm-up both
        time_ours(ours, tok, prompt, 1, 4)
        rows = []
        print(f"{'batch':>6} {'engine':>9} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>9} {'(other)':>9} {'MBU %':>7} "
              f"{'(matmul)':>8}")
        for batch in args.batch_sizes:
            read = weights + batch * kv_read_bytes(cfg, context)
            read_matmul = matmul + batch * kv_read_bytes(cfg, context)
            runs = {"nanochat": [], "ours": []}
            for name in ("nanochat", "ours", "ours", "nanochat"):
                run = (time_nanochat(engine, prompt, batch, args.decode) if name == "nanochat"
                       else time_ours(ours, tok, prompt, batch, args.decode))
                runs[name].append(summary(run, batch, read, read_matmul, bandwidth))
            for name, rs in runs.items():
                best, other = max(rs, key=lambda r: r["tokens_per_s"]), min(r["tokens_per_s"] for r in rs)
                rows.append({"batch": batch, "engine": name, **best, "other_tokens_per_s": other})
                print(f"{batch:6} {name:>9} {best['ttft_ms']:9.1f} {best['tpot_ms']:9.2f} "
                      f"{best['tokens_per_s']:9.1f} {other:9.1f} {best['mbu_percent']:7.1f} "
                      f"{best['mbu_matmul_percent']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "bandwidth": bandwidth,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
