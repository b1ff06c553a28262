"""The application's settings: one object per part, validated once from the config's `args`, passed whole.

    args (serve_config.yaml) -> AppArgs -> .chat     ChatSettings     -> ChatModel     -> .engine EngineConfig -> engine
                                        -> .decision DecisionSettings -> DecisionModel -> .scorer DecisionConfig -> scorer
                                        -> .ingress  IngressSettings  -> Ingress

The engine's and the scorer's settings are core's own records (EngineConfig, DecisionConfig), embedded here, so
each default is written once, where the code that uses it lives. The config's keys stay flat, as users have
them: `chat_<name>` is ChatSettings' `<name>` or the engine's (`chat_max_rows` -> chat.engine.max_rows;
`chat_engine_process` -> chat.engine.process), `decision_<name>` the same for the decision model and its scorer,
`device` both models', and any other key the Ingress's. The nested form (`chat: {max_rows: 64}`) means the same.

Several models: a `models:` list, each entry one model with its `kind` (chat or decision), `name`, `aliases`,
`checkpoint`, its own Serve deployment options under `deployment:` (replicas, autoscaling, resources, queues;
the deployment is named after the model), and any setting of its kind without the prefix (`max_rows`, `dtype`,
`max_batch_tokens`, ...). The flat `chat_`/`decision_` keys are then every entry's defaults. Without `models:`
the service holds one model of each kind, in the deployments `ChatModel` and `DecisionModel`.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.chat.async_engine import StreamHold
from core.chat.protocol import EngineConfig
from core.decision.config import DecisionConfig

DEMO_MODELS = Path(__file__).resolve().parent.parent / "models"


def checkpoint_time(path: str) -> int:
    """When a checkpoint was made, as /v1/models shows it: its config.json's modification time (Unix seconds)."""
    return int(os.path.getmtime(os.path.join(path, "config.json")))


def _route_into(data: Any, own: set[str], nested: str, record) -> Any:
    """Keys of `data` that are not the settings' own but name a field of `record` (as they are, or after
    `<nested>_`: `engine_backend`, `scorer_backend`) move into the `nested` dict; any other key stays, for
    pydantic to take or refuse."""
    if not isinstance(data, dict):
        return data
    names = {f.name for f in dataclasses.fields(record)}
    out, inner = {}, {}
    for key, value in data.items():
        name = key.removeprefix(f"{nested}_")
        if key == nested and isinstance(value, dict):
            inner.update(value)
        elif key not in own and name in names:
            inner[name] = value
        else:
            out[key] = value
    if inner:
        out[nested] = dataclasses.replace(out[nested], **inner) if nested in out else inner
    return out


class ChatSettings(BaseModel):
    """The chat deployment: which checkpoint, how it streams, and its engine."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str = str(DEMO_MODELS / "demo-chat")
    model_name: str | None = None                   # default: the checkpoint directory's name
    model_aliases: list[str] = []                   # other names clients may send as `model`
    device: str | None = None                       # "cuda", "cpu", or None for CUDA when present
    stream_interval: int = Field(1, ge=1)           # after a stream's first text, tokens per message to the Ingress
    stream_interval_s: float = Field(0.0, ge=0, le=1)   # ... or, when set, at most one message per this long
    engine: EngineConfig = EngineConfig()

    @model_validator(mode="before")
    @classmethod
    def _engine_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("engine"), str):   # chat_engine: synthetic (or model)
            data = {("engine_backend" if k == "engine" else k): v for k, v in data.items()}
        return _route_into(data, set(cls.model_fields), "engine", EngineConfig)

    @property
    def name(self) -> str:
        return self.model_name or os.path.basename(os.path.normpath(self.checkpoint))

    @property
    def hold(self) -> StreamHold:
        return StreamHold(self.stream_interval, self.stream_interval_s)


class DecisionSettings(BaseModel):
    """The decision deployment: which checkpoint, the names it answers to, and its scorer."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str = str(DEMO_MODELS / "demo-decision")
    model_name: str = "startlux-decision"
    model_aliases: list[str] = []                   # other names clients may send as `model` (e.g. "jev-latest")
    device: str | None = None
    torch_threads: int | None = None                # torch intra-op threads of the model (None: Ray's default)
    process: bool = True                            # the model in a child process of the replica (off: a thread)
    scorer: DecisionConfig = DecisionConfig()

    @model_validator(mode="before")
    @classmethod
    def _scorer_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("scorer"), str):   # decision_scorer: synthetic (or model)
            data = {("scorer_backend" if k == "scorer" else k): v for k, v in data.items()}
        return _route_into(data, set(cls.model_fields), "scorer", DecisionConfig)

    @property
    def name(self) -> str:
        return self.model_name


class BatchSettings(BaseModel):
    """The decision deployment's live settings (its `user_config`, applied by `reconfigure`)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(16, ge=1)           # requests in one decide_batch
    batch_wait_timeout_s: float = Field(0.01, ge=0)   # how long a batch waits to fill
    batches_in_flight: int = Field(2, ge=1, le=8)     # decide_batch calls sent to the scorer at a time: with 2,
                                                      # the next waits there while one runs (no idle gap)


class IngressSettings(BaseModel):
    """The Ingress: keys, request limits, retries and chat admission."""

    model_config = ConfigDict(extra="forbid")

    api_keys: list[str] = []                        # prefer api_keys_env: keys in a config file leak
    api_keys_env: str | None = None                 # name of an env var holding comma-separated keys
    max_body_bytes: int = 1_000_000
    max_json_depth: int = Field(64, ge=1)           # arrays and objects nested deeper: 400 (json_too_deep)
    max_messages: int = 256
    max_message_chars: int = 32_000
    max_n: int = 8
    max_questions: int = 64
    retry_timeout_s: float = 60.0                   # how long a call whose replica died is retried elsewhere
    max_chat_inflight: int | None = None            # generations one Ingress replica sends the chat model at once
    max_chat_waiting: int = 64                      # more waiting in the Ingress for a slot; beyond: 503
    refusal_delay_s: float = Field(0.0, ge=0, le=10)   # how long a refused generation waits for its 503
    token_channel: bool = True                      # chat messages after the first on one connection per chat
                                                    # replica (deployments/channel.py), not one Serve message each
    token_channel_host: str | None = None           # where the channel listens (default: the node's address,
                                                    # where chat replicas on other nodes reach it)

    def with_env_keys(self) -> "IngressSettings":
        """These settings with the keys of `api_keys_env` (read now, in the process that builds the app) added."""
        keys = [k for k in self.api_keys if k]
        if self.api_keys_env:
            keys += [k.strip() for k in os.environ.get(self.api_keys_env, "").split(",") if k.strip()]
        return self.model_copy(update={"api_keys": keys, "api_keys_env": None})


SECTIONS = {"chat": ChatSettings, "decision": DecisionSettings, "ingress": IngressSettings}
KINDS = {"chat": ChatSettings, "decision": DecisionSettings}
SINGLE = {"chat": "ChatModel", "decision": "DecisionModel"}   # the deployments of a service without `models:`


class ServedModel(BaseModel):
    """One model of the service: its kind, its settings, and the Serve deployment that holds it."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    kind: str
    settings: ChatSettings | DecisionSettings
    deployment_name: str
    deployment: dict = {}                           # Serve options (num_replicas, autoscaling_config, ...)

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def names(self) -> list[str]:
        return [self.name, *self.settings.model_aliases]


def _merged(defaults: dict, own: dict) -> dict:
    """An entry's settings over the flat defaults of its kind (nested dicts, e.g. `engine`, merged a level)."""
    out = dict(defaults)
    for key, value in own.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _entry(raw: Any, defaults: dict[str, dict]) -> dict:
    """One `models:` entry -> ServedModel's fields."""
    if not isinstance(raw, dict):
        raise ValueError(f"a `models:` entry is a mapping with a kind (chat or decision), not {raw!r}")
    own = dict(raw)
    kind = own.pop("kind", None)
    if kind not in KINDS:
        raise ValueError(f"a `models:` entry needs `kind: chat` or `kind: decision`, got {kind!r} (in {raw!r})")
    deployment = own.pop("deployment", {}) or {}
    if not isinstance(deployment, dict):
        raise ValueError(f"`deployment` of a `models:` entry is a mapping of Serve options, got {deployment!r}")
    for short, field in (("name", "model_name"), ("aliases", "model_aliases")):
        if short in own:
            own[field] = own.pop(short)
    settings = KINDS[kind].model_validate(_merged(defaults[kind], own))
    name = settings.name
    return {"kind": kind, "settings": settings, "deployment_name": name, "deployment": deployment}


class AppArgs(BaseModel):
    """The config's `args`: flat keys (see the module's docstring) or one dict per part, and optionally `models:`."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    chat: ChatSettings = ChatSettings()
    decision: DecisionSettings = DecisionSettings()
    ingress: IngressSettings = IngressSettings()
    models: list[ServedModel] = []                  # from `models:`; empty: one of each kind (served_models)

    def served_models(self) -> list[ServedModel]:
        """Every model of the service, in the config's order."""
        if self.models:
            return list(self.models)
        return [ServedModel(kind="chat", settings=self.chat, deployment_name=SINGLE["chat"]),
                ServedModel(kind="decision", settings=self.decision, deployment_name=SINGLE["decision"])]

    @model_validator(mode="after")
    def _unique_names(self) -> "AppArgs":
        seen: dict[str, str] = {}
        for m in self.served_models():
            for n in m.names:
                if n in seen:
                    raise ValueError(f"two models answer to {n!r} ({seen[n]} and {m.name}): each name and alias "
                                     f"names one model")
                seen[n] = m.name
        return self

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        parts: dict[str, dict] = {name: {} for name in SECTIONS}
        entries = None
        for key, value in data.items():
            if key == "models":
                if not isinstance(value, list) or not value:
                    raise ValueError("`models:` is a list of at least one model (each with its kind); without it the "
                                     "service holds one chat and one decision model")
                entries = value
            elif key in SECTIONS and isinstance(value, dict):
                parts[key].update(value)
            elif key == "device":
                parts["chat"].setdefault("device", value)
                parts["decision"].setdefault("device", value)
            elif key.startswith(("chat_", "decision_")):
                part, name = key.split("_", 1)
                parts[part][name] = value
            elif key in IngressSettings.model_fields:
                parts["ingress"][key] = value
            else:
                raise ValueError(f"unknown argument {key!r}: the arguments are chat_<setting>, decision_<setting>, "
                                 f"device, models, and the Ingress's ({', '.join(IngressSettings.model_fields)}); "
                                 f"docs/configuration.md lists them")
        out: dict[str, Any] = {name: part for name, part in parts.items() if part}
        if entries is not None:
            out["models"] = [_entry(e, parts) for e in entries]
        return out
