"""A Hugging Face `tokenizer.json` beside a checkpoint's `tokenizer.tiktoken`, for tools that load tokenizers
the Hugging Face way (lm-evaluation-harness, vLLM, `AutoTokenizer.from_pretrained(checkpoint_dir)`).

The tiktoken ranks become a byte-level BPE with transformers' TikTokenConverter, the special tokens added with
the ids they have here; on ordinary text the ids equal tiktoken's (a test checks). One difference is by design:
text that spells a special token (`<|bos|>`) is that token to a Hugging Face tokenizer, while this project's
prompter encodes such text as plain text. The keys transformers needs (`tokenizer_class`, `bos_token`) are added
to the checkpoint's own `tokenizer_config.json`, whose keys it ignores.
"""
from __future__ import annotations

import json
import os
import tempfile

from .config import read_json, write_json
from .tokenizer import ChatTokenizer


def write_hf_tokenizer(path: str, tokenizer: ChatTokenizer, sequence_len: int) -> None:
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get)
    converted = TikTokenConverter(vocab_file=os.path.join(path, "tokenizer.tiktoken"), pattern=tokenizer.pattern,
                                  extra_special_tokens=specials).converted()
    fast = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token="<|bos|>", model_max_length=sequence_len)
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        os.replace(os.path.join(tmp, "tokenizer.json"), os.path.join(path, "tokenizer.json"))
        with open(os.path.join(tmp, "tokenizer_config.json"), encoding="utf-8") as f:
            hf_config = json.load(f)
    config_path = os.path.join(path, "tokenizer_config.json")
    write_json(config_path, {**read_json(config_path), **hf_config})
