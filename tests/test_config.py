"""serve_config.yaml (production) and serve_config.cpu.yaml (local) describe the same application."""
import os

import pytest
import yaml

from deployments.app import AppArgs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    with open(os.path.join(ROOT, name)) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.cpu.yaml", "cluster/serve_config.local.yaml"])
def test_config_is_consistent(name):
    cfg = load(name)
    (app,) = cfg["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    AppArgs.model_validate(app["args"])                       # every arg is one the builder knows
    deps = {d["name"]: d for d in app["deployments"]}
    assert set(deps) == {"ChatModel", "DecisionModel", "Ingress"}
    decision = deps["DecisionModel"]
    assert decision["max_ongoing_requests"] >= decision["user_config"]["max_batch_size"]
    for d in deps.values():
        assert "max_queued_requests" in d and "max_ongoing_requests" in d
        assert not ("num_replicas" in d and "autoscaling_config" in d)
        auto = d.get("autoscaling_config")
        if auto:
            assert auto["min_replicas"] <= auto["max_replicas"]
            assert auto["target_ongoing_requests"] <= d["max_ongoing_requests"]
    rows = AppArgs.model_validate(app["args"]).chat.engine.max_rows
    assert deps["ChatModel"]["max_ongoing_requests"] >= rows
    # Serve's autoscaler counts the requests that reach the chat deployment: an Ingress limit below what
    # max_replicas replicas are meant to hold would hide the load that should add them (docs/deployment.md)
    auto, inflight = deps["ChatModel"].get("autoscaling_config"), app["args"].get("max_chat_inflight")
    if auto and inflight is not None:
        assert inflight >= auto["max_replicas"] * auto["target_ongoing_requests"]


def test_production_uses_gpus_and_local_does_not():
    prod = {d["name"]: d for d in load("serve_config.yaml")["applications"][0]["deployments"]}
    cpu = {d["name"]: d for d in load("serve_config.cpu.yaml")["applications"][0]["deployments"]}
    for name in ("ChatModel", "DecisionModel"):
        assert prod[name]["ray_actor_options"]["num_gpus"] == 1
        assert cpu[name]["ray_actor_options"]["num_gpus"] == 0
    assert load("serve_config.cpu.yaml")["applications"][0]["args"]["device"] == "cpu"
