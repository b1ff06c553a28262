"""The models behind the Ingress: each name and alias -> its kind, its deployment's handle and, once asked, its info.

The names come from the config (settings.py's `ServedModel`), so a request is routed without asking any model
first; a model's info (limits, sampling defaults, its checkpoint's time) is asked of its deployment when a request
first needs it and kept. A model that does not answer costs only the requests for it: /healthz and /v1/models ask
each model on its own.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ray.serve.handle import DeploymentHandle

from .errors import APIError, error



@dataclass
class Model:
    kind: str                         # "chat" or "decision"
    names: list[str]                  # its name, then its aliases
    handle: DeploymentHandle
    stream: DeploymentHandle | None = None     # chat: the handle with stream=True, built once
    _info: object | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.names[0]

    async def info(self):
        if self._info is None:
            self._info = await self.handle.info.remote()
        return self._info


class Registry:
    def __init__(self, models: list[dict]):
        """models: {"kind", "names", "handle"} per model, in the config's order (the first of a kind is the one a
        request without `model` gets)."""
        self.models = [Model(m["kind"], list(m["names"]), m["handle"],
                             m["handle"].options(stream=True) if m["kind"] == "chat" else None) for m in models]
        self._by_name = {n: m for m in self.models for n in m.names}

    def of_kind(self, kind: str) -> list[Model]:
        return [m for m in self.models if m.kind == kind]

    def get(self, kind: str, name: str | None) -> Model:
        """The model of `kind` a request names (None: the first of that kind), or the 404 that names those served."""
        if name is None:
            for m in self.models:
                if m.kind == kind:
                    return m
        else:
            m = self._by_name.get(name)
            if m is not None and m.kind == kind:
                return m
        served = ", ".join(repr(n) for m in self.of_kind(kind) for n in m.names) or "none"
        raise APIError(error(f"unknown model {name!r}; this service's {kind} models are {served}",
                             "not_found_error", "model", "model_not_found"))

    async def each(self, call, timeout: float | None = None) -> dict[str, object]:
        """call(model) -> awaitable, for every model at once -> {model name: its result, or the exception it raised
        (asyncio.TimeoutError after `timeout` seconds)}."""
        async def one(m: Model):
            try:
                return await asyncio.wait_for(call(m), timeout)
            except Exception as e:  # noqa: BLE001 - reported per model
                return e
        results = await asyncio.gather(*(one(m) for m in self.models))
        return {m.name: r for m, r in zip(self.models, results)}
