"""Our chat checkpoint layout, read and written without unpickling anything.

    config.json              ChatModelConfig: architecture and sizes
    model.safetensors        weights (the tied GPT-2 head is stored once, as the embedding)
    tokenizer.tiktoken       BPE ranks, tiktoken's format
    tokenizer_config.json    split pattern and special tokens (and the keys Hugging Face tools read)
    tokenizer.json           the same tokenizer for Hugging Face tools (hf_tokenizer.py)
    chat.json                optional: few-shot priming turns and default sampling values

This module reads the files a process needs to render prompts (config, tokenizer, defaults) and imports no
torch: a serving replica whose model runs in a child process never loads torch. The weights are read and
written by weights.py.
"""
from __future__ import annotations

import os

from .config import ChatDefaults, ChatModelConfig, CheckpointError, read_json
from .tokenizer import ChatTokenizer


def load_chat_defaults(path: str) -> ChatDefaults:
    p = os.path.join(path, "chat.json")
    return ChatDefaults.from_dict(read_json(p)) if os.path.isfile(p) else ChatDefaults()


def load_chat_tokenizer(path: str) -> tuple[ChatTokenizer, ChatModelConfig]:
    """The tokenizer and config of a checkpoint directory, without its weights (for a process that only
    renders prompts, such as a replica whose engine runs in a child process)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory")
    for name in ("config.json", "model.safetensors"):
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"{path}: missing {name}")
    config = ChatModelConfig.from_dict(read_json(os.path.join(path, "config.json")))
    tokenizer = ChatTokenizer.from_dir(path)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model only "
                              f"{config.vocab_size} embeddings")
    return tokenizer, config
