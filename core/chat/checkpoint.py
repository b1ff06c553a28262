"""Our chat checkpoint layout, read and written without unpickling anything.

    config.json              ChatModelConfig: architecture and sizes
    model.safetensors        weights (the tied GPT-2 head is stored once, as the embedding)
    tokenizer.tiktoken       BPE ranks, tiktoken's format
    tokenizer_config.json    split pattern and special tokens (and the keys Hugging Face tools read)
    tokenizer.json           the same tokenizer for Hugging Face tools (hf_tokenizer.py)
    chat.json                optional: few-shot priming turns and default sampling values
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from .config import ChatDefaults, ChatModelConfig, CheckpointError, read_json, write_json
from .hf_tokenizer import write_hf_tokenizer
from .model import ChatNetwork, build_model
from .tokenizer import ChatTokenizer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _stored_state(model: ChatNetwork) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.arch == "gpt2":
        state.pop("lm_head.weight")
    return {k: v.detach().contiguous().cpu() for k, v in state.items()}


def save_chat_model(path: str, model: ChatNetwork, tokenizer: ChatTokenizer, defaults: ChatDefaults | None = None,
                    dtype: torch.dtype | None = None) -> None:
    os.makedirs(path, exist_ok=True)
    state = _stored_state(model)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    save_file(state, os.path.join(path, "model.safetensors"))
    write_json(os.path.join(path, "config.json"), model.config.to_dict())
    tokenizer.save(path)
    write_hf_tokenizer(path, tokenizer, model.config.sequence_len)
    if defaults is not None:
        write_json(os.path.join(path, "chat.json"), defaults.to_dict())


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


def load_chat_model(path: str, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None) -> tuple[ChatNetwork, ChatTokenizer, ChatModelConfig]:
    """Load a checkpoint directory. Weights run in bf16 on CUDA and fp32 on CPU unless `dtype` says otherwise."""
    tokenizer, config = load_chat_tokenizer(path)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build_model(config)
    state = load_file(os.path.join(path, "model.safetensors"))
    expected = set(_stored_state(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match config.json (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]})")
    model.load_state_dict(state, strict=False)
    return model.to(device=device, dtype=dtype).eval(), tokenizer, config
