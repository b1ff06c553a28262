"""Regenerate the nanochat test data (tests/data/nanochat/<era>/) with nanochat's own code.

    python -m tools.nanochat_reference --nanochat DIR --era current --out tests/data/nanochat/current

DIR is a copy of karpathy/nanochat's source at the era's commit (the directory that holds the `nanochat`
package), fetched by hand; nothing of it is added to this repository. Each run writes what nanochat itself
produces for a tiny random model of that era:

- `model_000000.pt`, `meta_000000.json` by nanochat's `save_checkpoint` (the embeddings in bf16, as nanochat's
  GPU training stores them), and `tokenizer.pkl`, the pickled `tiktoken.Encoding` nanochat's tokenizer saves;
- `reference.safetensors`: nanochat's `GPT.forward` logits (fp32, CPU) for a 64-token and a 300-token prompt
  (every position of the first, every third of the second);
- `reference.json`: the prompts, and the greedy tokens of nanochat's `Engine.generate` for a few prompts.

The eras and their commits: `release` 306bc38 (2025-10-16, the first that runs on a CPU), `padded` ccf4b7f
(2026-01-07: vocabulary padded to a multiple of 64), `current` 92d63d4 (2026-07-03: lambdas, windows, value
embeddings, q/k scale, rotary base 100,000, smear, backout). Before 2026-03-04 nanochat asserts that its rotary
tables are bf16, even on a CPU; for those eras this script lifts that assertion and the cast before it, so the
tables are fp32 and the reference is the architecture's exact fp32 math (against bf16 tables our fp32 logits differ by ~4e-3).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pickle
import random
import sys
import types

import torch
from safetensors.torch import save_file

VOCAB = 300                 # not a multiple of 64: the padded eras pad it to 320
SIZES = dict(sequence_len=512, vocab_size=VOCAB, n_layer=4, n_head=4, n_kv_head=2, n_embd=32)
SCALARS = {"resid_lambdas": (0.9, 1.1), "x0_lambdas": (0.05, 0.25), "smear_lambda": (0.3, 0.7),
           "backout_lambda": (0.1, 0.3)}
GENERATE = (12, 40, 150, 280)      # prompt lengths for Engine.generate
MAX_TOKENS = 24


def _tokenizer():
    from core.chat.tokenizer import train_tokenizer

    words = "the cat sat on a mat what is capital of france paris hello how are you one two three".split()
    rng = random.Random(0)
    texts = (" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))) + "." for _ in range(2000))
    return train_tokenizer(texts, VOCAB).enc


# the two lines that keep the release era's rotary tables in bf16 (lifted: the tables stay fp32)
_BF16_ROTARY = ('assert self.cos.dtype == torch.bfloat16, "Rotary embeddings must be in bfloat16"',
                "cos, sin = cos.bfloat16(), sin.bfloat16() # keep them in bfloat16")


def _import_nanochat(src: str, lift_rotary_assert: bool):
    sys.path.insert(0, os.path.abspath(src))
    if lift_rotary_assert:
        path = os.path.join(src, "nanochat", "gpt.py")
        with open(path, encoding="utf-8") as f:
            code = f.read()
        for line in _BF16_ROTARY:
            if line not in code:
                raise SystemExit(f"{path}: {line!r} is not where this script expects it")
            code = code.replace(line, "pass")
        module = types.ModuleType("nanochat.gpt")
        module.__file__ = path
        sys.modules["nanochat.gpt"] = module
        importlib.import_module("nanochat")
        exec(compile(code, path, "exec"), module.__dict__)
    from nanochat import checkpoint_manager, engine, gpt, tokenizer
    return gpt, engine, checkpoint_manager, tokenizer


def _randomize(model, seed: int) -> None:
    """nanochat initialises its projections to zero; a test model needs every weight to matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in SCALARS:
                lo, hi = SCALARS[name]
                p.copy_(lo + (hi - lo) * torch.rand(p.shape, generator=g))
            elif "wte" in name or "value_embeds" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanochat", required=True, help="nanochat's source at the era's commit")
    ap.add_argument("--era", required=True, choices=("release", "padded", "current"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gpt, engine_mod, ckpt, tok_mod = _import_nanochat(args.nanochat, args.era != "current")

    enc = _tokenizer()
    config = gpt.GPTConfig(**SIZES)
    model = gpt.GPT(config)
    model.init_weights()
    _randomize(model, seed=7)
    state = {k: v.to(torch.bfloat16) if ("wte" in k or "value_embeds" in k) else v
             for k, v in model.state_dict().items()}
    os.makedirs(args.out, exist_ok=True)
    ckpt.save_checkpoint(args.out, 0, state, None, {"model_config": dataclasses.asdict(config), "step": 0})
    with open(os.path.join(args.out, "tokenizer.pkl"), "wb") as f:
        pickle.dump(enc, f)

    # the model as nanochat's loader builds it on a CPU: bf16 tensors of the checkpoint as fp32
    model.load_state_dict({k: v.float() for k, v in state.items()})
    model.eval()
    g = torch.Generator().manual_seed(11)
    bos = enc._special_tokens["<|bos|>"]
    ordinary = len(enc._mergeable_ranks)

    def prompt(n: int) -> list[int]:
        return [bos] + torch.randint(0, ordinary, (n - 1,), generator=g).tolist()

    short, long = prompt(64), prompt(300)
    with torch.no_grad():
        logits_short = model(torch.tensor([short]))[0].float()
        logits_long = model(torch.tensor([long]))[0].float()
    every_third = torch.arange(0, 300, 3)
    save_file({"short": logits_short.contiguous(), "long": logits_long[every_third].contiguous(),
               "long_positions": every_third}, os.path.join(args.out, "reference.safetensors"))

    tokenizer = tok_mod.RustBPETokenizer(enc, "<|bos|>")
    eng = engine_mod.Engine(model, tokenizer)
    generations = []
    for n in GENERATE:
        p = prompt(n)
        out = [column[0] for column, _ in eng.generate(p, num_samples=1, max_tokens=MAX_TOKENS, temperature=0.0)]
        generations.append({"prompt": p, "greedy": out})
    with open(os.path.join(args.out, "reference.json"), "w", encoding="utf-8") as f:
        json.dump({"era": args.era, "short": short, "long": long, "max_tokens": MAX_TOKENS,
                   "generations": generations}, f)
    print(f"wrote {args.out}: {len(generations)} greedy runs, logits {tuple(logits_short.shape)}, "
          f"{tuple(logits_long.shape)}")


if __name__ == "__main__":
    main()
