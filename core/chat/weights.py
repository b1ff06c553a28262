"""A chat checkpoint's weights (checkpoint.py describes the layout): written with the model's config and
tokenizer, read into a model on a device. safetensors only, nothing unpickled."""
from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from .checkpoint import load_chat_tokenizer
from .config import ChatDefaults, ChatModelConfig, CheckpointError, write_json
from .hf_tokenizer import write_hf_tokenizer
from .model import ChatNetwork, build_model
from .tokenizer import ChatTokenizer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def native_bf16(device: torch.device) -> str | None:
    """What computes bf16 natively on `device` ("CUDA", "AMX", "AVX-512 BF16"), or None (then bf16 would be
    emulated, slower than fp32)."""
    if device.type == "cuda":
        return "CUDA"
    if device.type == "cpu":
        if torch.cpu._is_amx_tile_supported():
            return "AMX"
        if torch.cpu._is_avx512_bf16_supported():
            return "AVX-512 BF16"
    return None


def chat_dtype(setting: str, device: torch.device) -> tuple[torch.dtype, str]:
    """EngineConfig.dtype on `device` -> (the dtype, why it was chosen)."""
    if setting == "float32":
        return torch.float32, "chat_dtype float32"
    if setting == "bfloat16":
        return torch.bfloat16, "chat_dtype bfloat16"
    native = native_bf16(device)
    if native:
        return torch.bfloat16, f"auto: {native} computes bf16 natively"
    return torch.float32, "auto: this CPU has no native bf16 (AMX or AVX-512 BF16)"


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
