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
    # nanochat's later architecture (docs/checkpoints.md has which version added what); the defaults are its
    # release's, so a config.json without these keys is a release-era model.
    qk_scale: float = 1.0           # queries and keys multiplied by this after their norm
    window_pattern: str = "L"       # per layer, tiled: L = full context, S = `short_window`; the last layer is L
    short_window: int = 0           # an S layer's query at position i sees keys i - short_window .. i
    residual_lambdas: bool = False  # resid_lambdas, x0_lambdas: x = resid[i] * x + x0[i] * x0 before block i
    value_embeds: bool = False      # value_embeds.{i} on every other layer ending at the last, gated by attn.ve_gate
    ve_gate_channels: int = 12      # the gate reads this many leading channels of the block's normed input
    ve_gate_range: float = 3.0      # the gate is range * sigmoid(...)
    smear: bool = False             # the previous token's normed embedding mixed in through smear_gate/smear_lambda
    backout: bool = False           # the residual after layer n_layer // 2, times backout_lambda, subtracted at the end

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(f"config.json: arch must be one of {ARCHITECTURES}, got {self.arch!r}")
        pattern = self.window_pattern.upper()
        if not pattern or set(pattern) - {"S", "L"}:
            raise CheckpointError(f"config.json: window_pattern must be letters S and L, got {self.window_pattern!r}")
        if "S" in pattern and self.short_window <= 0:
            raise CheckpointError("config.json: a window_pattern with S needs short_window > 0")
        if self.arch == "gpt2" and (pattern != "L" or self.qk_scale != 1.0 or self.residual_lambdas
                                    or self.value_embeds or self.smear or self.backout):
            raise CheckpointError("config.json: window_pattern, qk_scale, residual_lambdas, value_embeds, smear and "
                                  "backout are nanochat features; a gpt2 model has none of them")
        if self.n_embd % self.n_head:
            raise CheckpointError(f"config.json: n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            raise CheckpointError(f"config.json: n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
        if self.arch == "gpt2" and self.n_kv_head != self.n_head:
            raise CheckpointError("config.json: gpt2 has no grouped-query attention; set n_kv_head = n_head")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer, how many earlier positions a query sees (None: all), as nanochat tiles window_pattern."""
        pattern = self.window_pattern.upper()
        windows = [self.short_window if pattern[i % len(pattern)] == "S" and self.short_window < self.sequence_len
                   else None for i in range(self.n_layer)]
        windows[-1] = None
        return windows

    @property
    def value_embed_layers(self) -> list[int]:
        """The layers with a value embedding: every other one, ending at the last (nanochat's `has_ve`)."""
        return [i for i in range(self.n_layer) if i % 2 == (self.n_layer - 1) % 2] if self.value_embeds else []

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
