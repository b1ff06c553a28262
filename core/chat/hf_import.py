"""A transformers checkpoint directory (config.json, safetensors weights, tokenizer.json) in our layout.

Two architectures: `GPT2LMHeadModel` (as the `gpt2` checkpoints are published: Conv1D weights stored (in, out),
which become nanoGPT's (out, in)) and `NanoChatForCausalLM` (transformers' port of nanochat's release
architecture). The tokenizer's byte-level BPE becomes tiktoken ranks (a token's rank is its id, which is how
both GPT-2 and tiktoken-made vocabularies are ordered; a test checks the ids against the tokenizer itself). A
vocabulary without nanochat's chat special tokens (GPT-2's) gets them appended, with embedding rows set to
the mean of the others (what transformers' `resize_token_embeddings` starts new rows at), so a base model's
logits over its own vocabulary are unchanged; it needs chat fine-tuning before it uses them well.
"""
from __future__ import annotations

import json
import logging
import os

import torch
from safetensors.torch import load_file

from .config import ChatModelConfig, CheckpointError, read_json
from .tokenizer import SPECIAL_TOKENS, ChatTokenizer

logger = logging.getLogger(__name__)

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _weights(src: str) -> dict[str, torch.Tensor]:
    single = os.path.join(src, "model.safetensors")
    if os.path.isfile(single):
        return load_file(single)
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(read_json(index)["weight_map"].values())):
            state.update(load_file(os.path.join(src, shard)))
        return state
    raise CheckpointError(f"{src}: no model.safetensors (or model.safetensors.index.json); save the model with "
                          "save_pretrained(..., safe_serialization=True)")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes, reversed (the byte-level BPE alphabet of tokenizer.json)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _pattern(tok: dict) -> str:
    pre = tok.get("pre_tokenizer") or {}
    for p in pre.get("pretokenizers", [pre]):
        if p.get("type") == "Split" and "Regex" in p.get("pattern", {}):
            return p["pattern"]["Regex"]
        if p.get("type") == "ByteLevel" and p.get("use_regex", True):
            return GPT2_PATTERN
    raise CheckpointError("tokenizer.json: no byte-level split pattern (a Split regex or ByteLevel with use_regex)")


def read_hf_tokenizer(src: str) -> tuple[ChatTokenizer, int]:
    """tokenizer.json -> (ChatTokenizer, number of chat special tokens that had to be appended)."""
    path = os.path.join(src, "tokenizer.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{src}: no tokenizer.json")
    with open(path, encoding="utf-8") as f:
        tok = json.load(f)
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise CheckpointError(f"tokenizer.json: a {model.get('type')} model; only byte-level BPE converts")
    decode = _byte_decoder()
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", []) if t.get("special", True)}
    special_ids = set(specials.values())
    try:
        ordinary = {bytes(decode[c] for c in token): i for token, i in model["vocab"].items() if i not in special_ids}
    except KeyError as e:
        raise CheckpointError(f"tokenizer.json: token text outside the byte-level alphabet ({e})") from None
    pattern = _pattern(tok)
    missing = [s for s in SPECIAL_TOKENS if s not in specials]
    if missing:
        start = max([*ordinary.values(), *specials.values()]) + 1
        specials.update({s: start + i for i, s in enumerate(missing)})
    return ChatTokenizer(ordinary, pattern, specials, name="hf"), len(missing)


def _grow(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if rows <= weight.shape[0]:
        return weight
    extra = weight.float().mean(0, keepdim=True).expand(rows - weight.shape[0], -1).to(weight.dtype)
    return torch.cat([weight, extra])


def gpt2_state(config: dict, state: dict[str, torch.Tensor]) -> tuple[ChatModelConfig, dict[str, torch.Tensor]]:
    out = {}
    for k, v in state.items():
        k = k.removeprefix("transformer.")
        if k.endswith((".attn.bias", ".attn.masked_bias")) or k == "lm_head.weight":
            continue                                  # causal-mask buffers; the head is tied to wte
        out["transformer." + k] = v.t().contiguous() if k.endswith(_CONV1D) else v
    act = config.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise CheckpointError(f"config.json: activation_function {act!r}; GPT-2 uses gelu_new (tanh) or gelu")
    cfg = ChatModelConfig(arch="gpt2", vocab_size=config["vocab_size"], n_layer=config["n_layer"],
                          n_head=config["n_head"], n_kv_head=config["n_head"], n_embd=config["n_embd"],
                          sequence_len=config["n_positions"], layer_norm_eps=config.get("layer_norm_epsilon", 1e-5),
                          gelu_approximate="none" if act == "gelu" else "tanh")
    return cfg, out


def nanochat_state(config: dict, state: dict[str, torch.Tensor]) -> tuple[ChatModelConfig, dict[str, torch.Tensor]]:
    hidden = config["hidden_size"]
    if config.get("intermediate_size", 4 * hidden) != 4 * hidden:
        raise CheckpointError(f"config.json: intermediate_size {config['intermediate_size']}; nanochat's MLP is "
                              f"4 x hidden_size = {4 * hidden}")
    names = {"self_attn.q_proj": "attn.c_q", "self_attn.k_proj": "attn.c_k", "self_attn.v_proj": "attn.c_v",
             "self_attn.o_proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
    out = {}
    for k, v in state.items():
        if k == "model.embed_tokens.weight":
            out["transformer.wte.weight"] = v
        elif k == "lm_head.weight":
            out[k] = v
        elif k.startswith("model.layers."):
            i, rest = k.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            if module not in names:
                raise CheckpointError(f"{k}: not a weight of nanochat's architecture")
            out[f"transformer.h.{i}.{names[module]}.weight"] = v
        elif "rotary" not in k:
            raise CheckpointError(f"{k}: not a weight of nanochat's architecture")
    rope = config.get("rope_parameters") or {}
    cfg = ChatModelConfig(arch="nanochat", vocab_size=config["vocab_size"], n_layer=config["num_hidden_layers"],
                          n_head=config["num_attention_heads"],
                          n_kv_head=config.get("num_key_value_heads") or config["num_attention_heads"], n_embd=hidden,
                          sequence_len=config["max_position_embeddings"],
                          rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
                          logit_softcap=config.get("final_logit_softcapping") or 0.0,
                          rms_norm_eps=config.get("rms_norm_eps", 1e-6))
    return cfg, out


ARCHITECTURES = {"GPT2LMHeadModel": gpt2_state, "NanoChatForCausalLM": nanochat_state}


def read_transformers_dir(src: str) -> tuple[ChatModelConfig, dict[str, torch.Tensor], ChatTokenizer]:
    """-> our config, a state dict named as ours, and the tokenizer (chat special tokens appended if absent)."""
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise CheckpointError(f"{src}: no config.json (a transformers checkpoint directory)")
    config = read_json(os.path.join(src, "config.json"))
    arch = (config.get("architectures") or [None])[0] or {"gpt2": "GPT2LMHeadModel",
                                                           "nanochat": "NanoChatForCausalLM"}.get(config.get("model_type"))
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"config.json: architecture {arch!r}; this converter reads {sorted(ARCHITECTURES)}")
    cfg, state = ARCHITECTURES[arch](config, _weights(src))
    tok, added = read_hf_tokenizer(src)
    if tok.vocab_size > cfg.vocab_size:
        if added == 0:
            raise CheckpointError(f"tokenizer.json has {tok.vocab_size} tokens, the model {cfg.vocab_size} rows")
        logger.info("appended the chat special tokens %s (ids %d-%d) with mean embedding rows: fine-tune before "
                    "chatting", list(SPECIAL_TOKENS[-added:]), tok.vocab_size - added, tok.vocab_size - 1)
        for k in ("transformer.wte.weight", "lm_head.weight"):
            if k in state:
                state[k] = _grow(state[k], tok.vocab_size)
        cfg = ChatModelConfig(**{**cfg.to_dict(), "vocab_size": tok.vocab_size})
    return cfg, state, tok
