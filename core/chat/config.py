"""Checkpoint configuration records for chat models.

`config.json` describes the network (`ChatModelConfig`); the optional `chat.json` carries what the
checkpoint's authors want every conversation to start with and the sampling defaults
(`ChatDefaults`). Both are plain dataclasses read from and written to JSON so that a checkpoint
directory can be inspected and edited by hand.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from .protocol import SamplingDefaults, ToolFormat

ARCHITECTURES = ("nanochat", "gpt2")


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file or declares something we cannot load."""


@dataclass
class ChatModelConfig:
    arch: str = "nanochat"          # "nanochat" (rotary, QK-norm, relu^2, GQA) or "gpt2" (learned positions, GELU)
    vocab_size: int = 512
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 4              # grouped-query attention; gpt2 requires n_kv_head == n_head
    n_embd: int = 64
    sequence_len: int = 1024        # longest sequence (prompt + completion) a request may reach
    rope_theta: float = 10000.0     # nanochat only
    logit_softcap: float = 15.0     # nanochat only; 0 disables it
    rms_norm_eps: float = 1e-6      # nanochat only
    layer_norm_eps: float = 1e-5    # gpt2 only
    gelu_approximate: str = "none"  # gpt2 only: "none" (nanoGPT's nn.GELU) or "tanh" (OpenAI's GPT-2)

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(f"config.json: arch must be one of {ARCHITECTURES}, got {self.arch!r}")
        if self.n_embd % self.n_head:
            raise CheckpointError(f"config.json: n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            raise CheckpointError(f"config.json: n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
        if self.arch == "gpt2" and self.n_kv_head != self.n_head:
            raise CheckpointError("config.json: gpt2 has no grouped-query attention; set n_kv_head = n_head")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_dict(cls, data: dict) -> "ChatModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CheckpointError(f"config.json: unknown keys {unknown}")
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SAMPLING = SamplingDefaults()     # chat.json's sampling defaults are SamplingDefaults' own


@dataclass
class ChatDefaults:
    """chat.json: few-shot priming turns, default sampling values and the model's tool-call format."""

    fewshot: list[dict] = field(default_factory=list)   # [{"role": "user"|"assistant", "content": str}, ...]
    temperature: float = _SAMPLING.temperature
    top_k: int | None = _SAMPLING.top_k
    top_p: float = _SAMPLING.top_p
    max_tokens: int = _SAMPLING.max_tokens
    tool_call: dict | None = None      # {"start": text, "end": text}: ToolFormat

    @property
    def sampling(self) -> SamplingDefaults:
        return SamplingDefaults(self.temperature, self.top_k, self.top_p, self.max_tokens)

    @property
    def tool_format(self) -> "ToolFormat | None":
        return ToolFormat(**self.tool_call) if self.tool_call else None

    @classmethod
    def from_dict(cls, data: dict) -> "ChatDefaults":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CheckpointError(f"chat.json: unknown keys {unknown}")
        out = cls(**data)
        for i, turn in enumerate(out.fewshot):
            if turn.get("role") not in ("user", "assistant") or not isinstance(turn.get("content"), str):
                raise CheckpointError(f"chat.json: fewshot[{i}] needs role user|assistant and a string content")
        fmt = out.tool_call
        if fmt is not None and (not isinstance(fmt, dict) or set(fmt) != {"start", "end"} or not all(
                isinstance(v, str) and v and not set(v) & set('{}[]"') for v in fmt.values())):
            raise CheckpointError('chat.json: tool_call must be {"start": text, "end": text}, two non-empty texts '
                                  'without braces, brackets or quotes')
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)
