"""The application builder that serve_config.yaml names: `import_path: deployments.app:build_app`.

Configuration flows one way: the config's `args` -> `AppArgs` (settings.py: one settings object per part) ->
each deployment's constructor, whole. Each model is a deployment of its own (ChatModel or DecisionModel's code,
named after the model when the config lists `models:`); the Ingress gets every model's handle. Replica counts,
autoscaling, resources, queues and health checks belong to the config's `deployments:` section (by deployment
name) or, for a model of `models:`, to its entry's `deployment:`.
"""
from __future__ import annotations

import os

from ray.serve import Application

from .chat import ChatModel
from .decision import DecisionModel
from .ingress import Ingress
from .settings import AppArgs

__all__ = ["AppArgs", "build_app", "wire"]


def build_app(args: dict) -> Application:
    """Serve's application builder: `args` from the config, deployment options from its `deployments:`."""
    return wire(AppArgs.model_validate(args or {}))


def wire(a: AppArgs, options: dict[str, dict] | None = None) -> Application:
    """The deployment graph. `options` ({"ChatModel": {...}, ...}) is for programmatic use (tests, notebooks);
    under `serve run` / `serve deploy` the config file's `deployments:` section sets them. The chat and decision
    checkpoints are made absolute here, in the process that reads the config; API keys from `api_keys_env`
    are read here too."""
    options = options or {}
    models = []
    for m in a.served_models():
        settings = m.settings.model_copy(update={"checkpoint": os.path.abspath(m.settings.checkpoint)})
        code = ChatModel if m.kind == "chat" else DecisionModel
        opts = {**m.deployment, **options.get(m.deployment_name, {})}
        models.append({"kind": m.kind, "names": m.names,
                       "handle": code.options(name=m.deployment_name, **opts).bind(settings)})
    return Ingress.options(**options.get("Ingress", {})).bind(models, a.ingress.with_env_keys())

