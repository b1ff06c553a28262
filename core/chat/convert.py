"""Convert checkpoints from other layouts into ours.

    python -m core.chat.convert nanochat SRC DST [--step N] [--tokenizer PATH] [--rope-base B] [--qk-scale S]
                                [--logit-softcap C] [--short-window W]
    python -m core.chat.convert transformers SRC DST      (GPT2LMHeadModel or NanoChatForCausalLM)
    python -m core.chat.convert state-dict SRC DST --arch gpt2|nanochat --n-head H [--n-kv-head K]
                                [--sequence-len L] --tokenizer gpt2|DIR|FILE.tiktoken

This is the only place in the project that reads a pickle: nanochat's `tokenizer.pkl` is an
unpickled `tiktoken.Encoding`, so only convert files you trust. Weights are read with
`torch.load(weights_only=True)`, which does not run code.
"""
from __future__ import annotations

import argparse
import glob
import logging
import os
import pickle
import re

import torch
import tiktoken

from .weights import save_chat_model
from .config import ChatModelConfig, CheckpointError, read_json
from .hf_import import GPT2_PATTERN, read_transformers_dir
from .model import build_model
from .nanochat_versions import Version, config_fields, crop_padding, recognise
from .tokenizer import DEFAULT_PATTERN, ChatTokenizer, read_ranks

logger = logging.getLogger(__name__)

# buffers some nanoGPT versions store next to the weights
_IGNORED = re.compile(r"\.attn\.(bias|masked_bias)$")


def clean_state_dict(state: dict) -> dict[str, torch.Tensor]:
    """Strip torch.compile's `_orig_mod.` prefix and drop non-weight buffers."""
    out = {}
    for k, v in state.items():
        k = k.replace("_orig_mod.", "")
        if not _IGNORED.search(k):
            out[k] = v
    return out


def read_pickled_tokenizer(path: str) -> ChatTokenizer:
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.pkl")
    logger.warning("unpickling %s (trusted input only: a pickle can run code)", path)
    with open(path, "rb") as f:
        enc = pickle.load(f)
    if not isinstance(enc, tiktoken.Encoding):
        raise CheckpointError(f"{path}: expected a pickled tiktoken.Encoding, got {type(enc).__name__}")
    return ChatTokenizer.from_encoding(enc)


def read_tokenizer(spec: str, pattern: str) -> ChatTokenizer:
    """`gpt2` (tiktoken's GPT-2 encoding, chat special tokens appended from 50257 as seed 001 does), a directory
    in our layout, a nanochat tokenizer.pkl, or a `.tiktoken` ranks file (special tokens appended)."""
    if spec == "gpt2":
        enc = tiktoken.get_encoding("gpt2")
        return ChatTokenizer.from_ranks(enc._mergeable_ranks, enc._pat_str)
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.tiktoken")):
        return ChatTokenizer.from_dir(spec)
    if spec.endswith(".pkl") or (os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.pkl"))):
        return read_pickled_tokenizer(spec)
    if os.path.isfile(spec):
        return ChatTokenizer.from_ranks(read_ranks(spec), pattern)
    raise CheckpointError(f"--tokenizer {spec!r}: not 'gpt2', a tokenizer directory, tokenizer.pkl or a .tiktoken file")


def _load_into(config: ChatModelConfig, state: dict):
    model = build_model(config)
    expected = set(model.state_dict())
    if config.arch == "gpt2":
        state = dict(state)
        state.setdefault("lm_head.weight", state.get("transformer.wte.weight"))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"state dict does not match a {config.arch} model of these sizes "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval()


def _nanochat_files(src: str, step: int | None) -> tuple[str, str]:
    steps = sorted(int(m.group(1)) for p in glob.glob(os.path.join(src, "model_*.pt"))
                   if (m := re.search(r"model_(\d+)\.pt$", p)))
    if not steps:
        raise CheckpointError(f"{src}: no model_<step>.pt (a nanochat checkpoint directory, such as "
                              "~/.cache/nanochat/chatsft_checkpoints/d20, holds model_<step>.pt and meta_<step>.json)")
    step = steps[-1] if step is None else step
    meta_path = [p for p in glob.glob(os.path.join(src, "meta_*.json")) if re.search(rf"meta_0*{step}\.json$", p)]
    model_path = [p for p in glob.glob(os.path.join(src, "model_*.pt")) if re.search(rf"model_0*{step}\.pt$", p)]
    if not meta_path or not model_path:
        raise CheckpointError(f"{src}: no model/meta files for step {step}")
    return model_path[0], meta_path[0]


def convert_nanochat(src: str, dst: str, step: int | None = None, tokenizer: str | None = None,
                     **overrides) -> Version:
    """A nanochat checkpoint of any version since its release -> our layout; -> the version recognised.
    overrides: rope_theta, qk_scale, logit_softcap, short_window (nanochat_versions.config_fields)."""
    model_path, meta_path = _nanochat_files(src, step)
    mc = read_json(meta_path)["model_config"]
    state = clean_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
    state, dropped = crop_padding(state, mc["vocab_size"])
    version = recognise(state, mc["n_layer"])
    config = ChatModelConfig(**config_fields(version, mc, **{k: v for k, v in overrides.items() if v is not None}))
    logger.info("nanochat version %r (since %s)%s; window_pattern %s, short window %d", version.name,
                version.since, f", {dropped} padding rows of the vocabulary dropped" if dropped else "",
                config.window_pattern, config.short_window)
    try:
        model = _load_into(config, state)
    except CheckpointError as e:
        raise CheckpointError(f"{e}: the state dict matches no nanochat version this converter knows (it looks "
                              f"closest to {version.name!r}, since {version.since}; docs/checkpoints.md lists "
                              "the versions)") from None
    tok = read_tokenizer(tokenizer or src, DEFAULT_PATTERN)
    if tok.vocab_size != config.vocab_size:
        raise CheckpointError(f"the tokenizer has {tok.vocab_size} tokens, meta's model_config.vocab_size is "
                              f"{config.vocab_size}: pass the tokenizer this model was trained with (--tokenizer)")
    save_chat_model(dst, model, tok)
    return version


def convert_transformers(src: str, dst: str) -> None:
    config, state, tok = read_transformers_dir(src)
    save_chat_model(dst, _load_into(config, state), tok)


def infer_config(state: dict, arch: str, n_head: int, n_kv_head: int | None, sequence_len: int | None):
    n_layer = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"transformer\.h\.(\d+)\.", k)))
    vocab, n_embd = state["transformer.wte.weight"].shape
    if arch == "gpt2":
        return ChatModelConfig(arch="gpt2", vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_kv_head=n_head,
                               n_embd=n_embd, sequence_len=state["transformer.wpe.weight"].shape[0])
    head_dim = n_embd // n_head
    kv = n_kv_head or state["transformer.h.0.attn.c_k.weight"].shape[0] // head_dim
    return ChatModelConfig(arch="nanochat", vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_kv_head=kv,
                           n_embd=n_embd, sequence_len=sequence_len or 2048)


def convert_state_dict(src: str, dst: str, arch: str, n_head: int, tokenizer: str, n_kv_head: int | None = None,
                       sequence_len: int | None = None) -> None:
    state = clean_state_dict(torch.load(src, map_location="cpu", weights_only=True))
    config = infer_config(state, arch, n_head, n_kv_head, sequence_len)
    model = _load_into(config, state)
    tok = read_tokenizer(tokenizer, GPT2_PATTERN if arch == "gpt2" else DEFAULT_PATTERN)
    save_chat_model(dst, model, tok)


def hf_gpt2(model, bos: int | None = None, eos: int | None = None):
    """Our gpt2-architecture network as transformers' GPT2LMHeadModel with the same weights (GPT-2 ties its head
    to the token embedding, as ours does); `bos`, `eos`: the tokenizer's, for its config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=c.vocab_size, n_positions=c.sequence_len, n_embd=c.n_embd,
                                    n_layer=c.n_layer, n_head=c.n_head, activation_function="gelu",
                                    layer_norm_epsilon=c.layer_norm_eps, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                                    bos_token_id=bos, eos_token_id=eos))
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        # nanoGPT's nn.Linear stores (out, in); GPT-2's Conv1D stores (in, out)
        if any(k.endswith(s) for s in ("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            v = v.t()
        sd[k] = v.contiguous()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise CheckpointError(f"GPT-2 export: unexpected {unexpected}, missing {missing}")
    return hf.eval()


def export_hf_gpt2(model, checkpoint: str, dst: str) -> None:
    """Write a gpt2-architecture checkpoint (`model`, saved at `checkpoint` in our layout) in transformers' layout
    at `dst`, with the checkpoint's Hugging Face tokenizer files: what vLLM or transformers load."""
    import shutil

    from .checkpoint import load_chat_tokenizer

    tok = load_chat_tokenizer(checkpoint)[0]
    hf_gpt2(model, tok.bos_id, tok.encode_special("<|assistant_end|>")).save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(checkpoint, name), os.path.join(dst, name))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m core.chat.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kind", required=True)
    a = sub.add_parser("nanochat", help="a nanochat checkpoint directory (model_<step>.pt, meta_<step>.json)")
    a.add_argument("src"), a.add_argument("dst")
    a.add_argument("--step", type=int, help="which step (default: the latest)")
    a.add_argument("--tokenizer", help="tokenizer directory or tokenizer.pkl (default: SRC/tokenizer.pkl)")
    a.add_argument("--rope-base", type=float, help="rotary base (default: the recognised version's, 10000 before "
                   "2026-03-09, 100000 since)")
    a.add_argument("--qk-scale", type=float, help="queries' and keys' scale after their norm (default: the "
                   "version's: 1 before 2026-03-09, 1.15, 1.2 since 2026-03-14)")
    a.add_argument("--logit-softcap", type=float, help="default 15; nanochat used 20 from 2026-03-02 to 2026-03-08")
    a.add_argument("--short-window", type=int, help="keys an S layer of window_pattern sees (default: the "
                   "version's: sequence_len/2, /3 or /4 rounded up to 128)")
    t = sub.add_parser("transformers", help="a transformers checkpoint directory (config.json, model.safetensors, "
                       "tokenizer.json): GPT2LMHeadModel or NanoChatForCausalLM")
    t.add_argument("src"), t.add_argument("dst")
    b = sub.add_parser("state-dict", help="a plain state_dict file like seed 001's")
    b.add_argument("src"), b.add_argument("dst")
    b.add_argument("--arch", choices=("gpt2", "nanochat"), required=True)
    b.add_argument("--n-head", type=int, required=True)
    b.add_argument("--n-kv-head", type=int)
    b.add_argument("--sequence-len", type=int, help="nanochat arch only (gpt2 reads it from wpe)")
    b.add_argument("--tokenizer", required=True, help="gpt2, a tokenizer directory, or a .tiktoken ranks file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.kind == "nanochat":
        convert_nanochat(args.src, args.dst, args.step, args.tokenizer, rope_theta=args.rope_base,
                         qk_scale=args.qk_scale, logit_softcap=args.logit_softcap, short_window=args.short_window)
    elif args.kind == "transformers":
        convert_transformers(args.src, args.dst)
    else:
        convert_state_dict(args.src, args.dst, args.arch, args.n_head, args.tokenizer, args.n_kv_head,
                           args.sequence_len)
    logger.info("wrote %s", args.dst)


if __name__ == "__main__":
    main()
