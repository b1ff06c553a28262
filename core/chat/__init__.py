"""The chat side of core: nanochat-style models, tokenizer, prompter, sampler, calculator and engine.

Names are loaded on first use, so that importing one torch-free module (`core.chat.protocol`, the prompter)
does not import torch: the Ingress process imports the protocol and never runs a model.
"""
import importlib

_WHERE = {
    "load_chat_defaults": "checkpoint", "load_chat_tokenizer": "checkpoint",
    "load_chat_model": "weights", "save_chat_model": "weights",
    "ChatDefaults": "config", "ChatModelConfig": "config", "CheckpointError": "config",
    "LLMEngine": "engine",
    "build_model": "model", "ChatNetwork": "model",
    "ChatPrompter": "prompter", "PromptError": "prompter", "PromptTooLong": "prompter",
    "EngineConfig": "protocol", "EngineDied": "protocol", "EngineError": "protocol", "EngineFull": "protocol",
    "GenerateRequest": "protocol", "SamplingError": "protocol", "SamplingParams": "protocol",
    "StreamError": "protocol", "TokenEvent": "protocol",
    "SPECIAL_TOKENS": "tokenizer", "ChatTokenizer": "tokenizer",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'core.chat' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
