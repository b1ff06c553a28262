"""The application builder that serve_config.yaml names: `import_path: deployments.app:build_app`.

Configuration flows one way: the config's `args` -> `AppArgs` -> deployment constructors. Replica counts,
autoscaling, resources, queues and health checks belong to the config's `deployments:` section.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from ray.serve import Application

from .chat import ChatModel
from .decision import DecisionModel
from .ingress import Ingress

DEMO_MODELS = Path(__file__).resolve().parent.parent / "models"


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chat_checkpoint: str = str(DEMO_MODELS / "demo-chat")
    chat_model_name: str | None = None              # default: the checkpoint directory's name
    decision_checkpoint: str = str(DEMO_MODELS / "demo-decision")
    decision_model_name: str = "startlux-decision"
    decision_model_aliases: list[str] = []          # other names clients may send as `model` (e.g. "jev-latest")
    device: str | None = None                       # "cuda", "cpu", or None for CUDA when present
    chat_max_rows: int = 32                         # concurrent sequences per chat replica (KV-cache rows)
    chat_prefill_chunk: int = 512
    chat_max_waiting: int = 256                     # requests queued inside one engine before 503
    chat_engine_process: bool = True                # step the model in a child process of the replica
    chat_torch_threads: int | None = None           # torch intra-op threads of the chat model (None: torch's)
    chat_cuda_graphs: bool = True                   # on CUDA, decode passes replay recorded graphs
    chat_engine_cpu_policy: Literal["normal", "idle"] = "normal"   # "idle": SCHED_IDLE engine, for CPU hosts
    chat_stream_interval: int = Field(1, ge=1)      # after a stream's first text, tokens per message to the ingress
    chat_prefix_caching: bool = True                # reuse the KV rows finished requests leave (multi-turn chat)
    decision_max_length: int = 65536
    decision_max_batch_tokens: int = 65536
    decision_graphs: bool = True
    decision_prefix_cache_mb: float = Field(256, ge=0)   # prefix states kept across decision requests (0: none)
    decision_torch_threads: int | None = None       # torch intra-op threads of the decision model (None: torch's)
    api_keys: list[str] = []                        # prefer api_keys_env: keys in a config file leak
    api_keys_env: str | None = None                 # name of an env var holding comma-separated keys
    max_body_bytes: int = 1_000_000
    max_messages: int = 256
    max_message_chars: int = 32_000
    max_n: int = 8
    max_questions: int = 64
    retry_timeout_s: float = 60.0                   # how long a call whose replica died is retried elsewhere
    max_chat_inflight: int | None = None            # generations one Ingress replica sends the chat model at once
    max_chat_waiting: int = 64                      # more waiting in the Ingress for a slot; beyond: 503
    refusal_delay_s: float = Field(0.0, ge=0, le=10)   # how long a refused generation waits for its 503


def build_app(args: dict) -> Application:
    """Serve's application builder: `args` from the config, deployment options from its `deployments:`."""
    return wire(AppArgs.model_validate(args or {}))


def wire(a: AppArgs, options: dict[str, dict] | None = None) -> Application:
    """The deployment graph. `options` ({"ChatModel": {...}, ...}) is for programmatic use (tests, notebooks);
    under `serve run` / `serve deploy` the config file's `deployments:` section sets them."""
    options = options or {}
    keys = list(a.api_keys)
    if a.api_keys_env:
        keys += [k.strip() for k in os.environ.get(a.api_keys_env, "").split(",") if k.strip()]
    chat = ChatModel.options(**options.get("ChatModel", {})).bind(
        os.path.abspath(a.chat_checkpoint), a.device, a.chat_model_name, a.chat_max_rows, a.chat_prefill_chunk,
        a.chat_max_waiting, a.chat_engine_process, a.chat_torch_threads,
        a.chat_cuda_graphs, a.chat_engine_cpu_policy, a.chat_stream_interval, a.chat_prefix_caching)
    decision = DecisionModel.options(**options.get("DecisionModel", {})).bind(
        os.path.abspath(a.decision_checkpoint), a.device, a.decision_model_name, a.decision_max_length,
        a.decision_max_batch_tokens, a.decision_graphs, tuple(a.decision_model_aliases), a.decision_prefix_cache_mb,
        a.decision_torch_threads)
    return Ingress.options(**options.get("Ingress", {})).bind(
        chat, decision, keys, a.max_body_bytes, a.max_messages, a.max_message_chars, a.max_n, a.max_questions,
        a.retry_timeout_s, a.max_chat_inflight, a.max_chat_waiting, a.refusal_delay_s)
