"""Building StartLux-Decision checkpoint directories: for tests, benchmarks and the demo model (reading one is
config.py's `CheckpointConfig.read` and the scorer's).

A checkpoint is a transformers directory (config.json with `architectures`, model.safetensors, tokenizer
files) plus `decision_config.json`:

    {"letter_token_ids": [26 ids of " A".." Z"], "temperature_by_type": {"choice": 1.0, ...},
     "wide_choice": {"group": 25, "keep": 3, "residual": 0.001, "max_options": 26},
     "template": {...optional jevfmt keys...}}
"""
from __future__ import annotations

import json
import os
import string

from . import jevfmt as J

SPECIALS = ("<pad>", "<eos>")


def letter_lines() -> list[str]:
    """Text that makes every answer letter (as the default template writes it) a single BPE token."""
    return [f"Answer: {c}\n{c}. option\n" for c in string.ascii_uppercase] * 50


def train_decision_tokenizer(texts, vocab_size: int = 1024):
    """A byte-level BPE trained locally with the `tokenizers` library, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts) + letter_lines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def hybrid_text_config(vocab_size: int, hidden: int = 64, layers: int = 4, heads: int = 4, full_every: int = 4,
                       max_positions: int = 65536, pad_token_id: int = 0):
    """A Qwen3.5 text config: Gated DeltaNet layers with a full-attention layer every `full_every`."""
    from transformers import Qwen3_5TextConfig

    head_dim = hidden // heads
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=head_dim,
        linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2), linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(layers)],
        max_position_embeddings=max_positions, pad_token_id=pad_token_id, tie_word_embeddings=False)


def new_hybrid_model(text_config, multimodal: bool = False, seed: int = 0):
    """Random weights; `multimodal` wraps the text decoder in Qwen3_5ForConditionalGeneration with a tiny vision
    tower, the layout of checkpoints that keep the decoder under `.language_model`."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    if not multimodal:
        return Qwen3_5ForCausalLM(text_config).eval()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text_config.hidden_size,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text_config.to_dict(),
                                                         vision_config=vision)).eval()


def save_decision_checkpoint(path: str, model, tokenizer, temperature_by_type: dict | None = None,
                             wide_choice: dict | None = None, template: dict | None = None) -> None:
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    tpl = J.template_from({"template": template or {}})
    cfg = {"letter_token_ids": J.letter_token_ids(tokenizer, tpl),
           "temperature_by_type": temperature_by_type or {"choice": 1.0, "noul": 1.0, "score": 1.0},
           "wide_choice": wide_choice or {"group": 25, "keep": 3, "residual": 1e-3}}
    if template:
        cfg["template"] = template
    with open(os.path.join(path, "decision_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
