"""The chat side of core: nanochat-style models, tokenizer, prompter, sampler, calculator and engine."""
from .checkpoint import load_chat_defaults, load_chat_model, load_chat_tokenizer, save_chat_model
from .config import ChatDefaults, ChatModelConfig, CheckpointError
from .engine import Engine, EngineError, EngineFull, LLMEngine, TokenEvent
from .model import build_model
from .prompter import ChatPrompter, PromptError, PromptTooLong
from .sampler import SamplingError, SamplingParams
from .tokenizer import SPECIAL_TOKENS, ChatTokenizer

__all__ = [
    "ChatDefaults", "ChatModelConfig", "ChatPrompter", "ChatTokenizer", "CheckpointError", "Engine", "EngineError",
    "EngineFull", "LLMEngine", "PromptError", "PromptTooLong", "SPECIAL_TOKENS", "SamplingError", "SamplingParams",
    "TokenEvent", "build_model", "load_chat_defaults", "load_chat_model", "load_chat_tokenizer", "save_chat_model",
]
