"""Settings passed whole: every shipped config's values reach the engine, the scorer and the Ingress.

Each part is built from the config as Serve would build it (the deployment classes outside Serve), with only
the checkpoint and device moved to the demo models on this CPU; the values are then read back from the objects
that use them (the engine's scheduler, the scorer, the batcher, the admission), not from the settings.
"""
import os

import pytest
import torch
import yaml

from core.chat.engine_process import build_engine
from core.chat.kv_cache import KVCache
from core.chat.protocol import KV_CPU_BYTES, EngineConfig
from core.decision.config import DecisionConfig
from deployments.settings import AppArgs, BatchSettings, IngressSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["serve_config.yaml", "serve_config.cpu.yaml", "cluster/serve_config.local.yaml"]
DEMO = os.path.join(ROOT, "models")


def shipped(name):
    with open(os.path.join(ROOT, name)) as f:
        (app,) = yaml.safe_load(f)["applications"]
    return app["args"], {d["name"]: d for d in app["deployments"]}


def expect(args: dict, key: str, default):
    return args.get(key, default)


@pytest.mark.parametrize("name", CONFIGS)
def test_chat_values_reach_the_engine(name):
    from deployments.chat import ChatModel

    args, _ = shipped(name)
    settings = AppArgs.model_validate(args).chat
    assert settings.device == args.get("device")
    started = []

    class Recorder:
        max_rows = 0
        linear = "torch"

        def __init__(self, start, on_stats=None, hold=None):
            started.append((start, hold))

        def shutdown(self):
            pass

    demo = settings.model_copy(update={"checkpoint": os.path.join(DEMO, "demo-chat"), "device": "cpu"})
    model = ChatModel.func_or_class(demo, start_engine=Recorder)
    ((start, hold),) = started
    d = EngineConfig()
    assert model.settings.stream_interval == hold.tokens == expect(args, "chat_stream_interval", 1)
    assert hold.seconds == expect(args, "chat_stream_interval_s", 0.0)
    config = start.config
    assert config.process == expect(args, "chat_engine_process", d.process)
    assert config.torch_threads == expect(args, "chat_torch_threads", d.torch_threads)
    assert config.cpu_policy == expect(args, "chat_engine_cpu_policy", d.cpu_policy)
    assert config.cuda_graphs == expect(args, "chat_cuda_graphs", d.cuda_graphs)
    assert start.prefix_ids == tuple(model.prompter.prefix_ids)
    threads = torch.get_num_threads()
    try:
        engine = build_engine(start)
    finally:
        torch.set_num_threads(threads)
    sched = engine.scheduler
    assert engine.max_rows == sched.max_rows == expect(args, "chat_max_rows", d.max_rows)
    assert sched.prefill_chunk == expect(args, "chat_prefill_chunk", d.prefill_chunk)
    assert sched.max_waiting == expect(args, "chat_max_waiting", d.max_waiting)
    assert sched.prefix_caching == expect(args, "chat_prefix_caching", d.prefix_caching)
    assert engine.prefix_ids == list(start.prefix_ids)
    assert engine.cache.block_size == expect(args, "chat_block_size", d.block_size)
    memory = expect(args, "chat_kv_cache_memory", d.kv_cache_memory) or KV_CPU_BYTES
    assert memory - engine.cache.nbytes() < KVCache.block_bytes(engine.model.config, engine.cache.block_size,
                                                                 engine.cache.dtype) <= memory


@pytest.mark.parametrize("name", CONFIGS)
def test_decision_values_reach_the_scorer_and_the_batcher(name):
    from deployments.decision import DecisionModel

    args, deps = shipped(name)
    settings = AppArgs.model_validate(args).decision
    assert settings.device == args.get("device")
    demo = settings.model_copy(update={"checkpoint": os.path.join(DEMO, "demo-decision"), "device": "cpu"})
    assert demo.process == expect(args, "decision_process", True)
    model = DecisionModel.func_or_class(demo)        # the scorer in its child process, as deployed
    try:
        _check_decision_model(model, args, deps)
    finally:
        model.scorer.shutdown()


def _check_decision_model(model, args, deps):
    d = DecisionConfig()
    info = model.scorer.info                         # reported by the scorer's own process
    assert info.pid != os.getpid()
    if "decision_torch_threads" in args:
        assert info.torch_threads == args["decision_torch_threads"]
    assert info.max_length == expect(args, "decision_max_length", d.max_length)
    assert info.max_batch_tokens == expect(args, "decision_max_batch_tokens", d.max_batch_tokens)
    assert info.prefix_cache_bytes == int(expect(args, "decision_prefix_cache_mb", d.prefix_cache_mb) * 2 ** 20)
    assert info.graphs == expect(args, "decision_graphs", d.graphs)
    assert model.name == expect(args, "decision_model_name", "startlux-decision")
    assert model.aliases == expect(args, "decision_model_aliases", [])
    user = deps["DecisionModel"].get("user_config", {})
    model.reconfigure(user)
    b = BatchSettings()
    assert model._batched._get_max_batch_size() == user.get("max_batch_size", b.max_batch_size)
    assert model._batched._get_batch_wait_timeout_s() == user.get("batch_wait_timeout_s", b.batch_wait_timeout_s)
    assert model.merger.max_size == user.get("max_batch_size", b.max_batch_size)
    assert model.merger.depth == user.get("batches_in_flight", b.batches_in_flight)
    model.reconfigure({**user, "batches_in_flight": 1})          # live: the merger's depth follows
    assert model.merger.depth == 1


@pytest.mark.parametrize("name", CONFIGS)
def test_ingress_values_reach_its_parts(name, monkeypatch):
    from deployments.ingress import Ingress

    args, _ = shipped(name)
    monkeypatch.setenv(args.get("api_keys_env") or "UNUSED_KEYS", "k1, k2")
    settings = AppArgs.model_validate(args).ingress.with_env_keys()
    ours = Ingress.func_or_class.__mro__[1]          # the class under Serve's ASGI wrapper (whose __init__ is async)
    assert ours.__module__ == "deployments.ingress" and "__init__" in vars(ours)
    handle = type("Handle", (), {"options": lambda self, **kw: self})()
    ingress = ours([{"kind": "chat", "names": ["c"], "handle": handle},
                    {"kind": "decision", "names": ["d"], "handle": handle}], settings)
    d = IngressSettings()
    assert ingress.api_keys == (["k1", "k2"] if args.get("api_keys_env") else args.get("api_keys", []))
    (admission,) = ingress.chat_admissions.values()              # one per chat model
    assert admission.limit == expect(args, "max_chat_inflight", d.max_chat_inflight)
    assert admission.max_waiting == expect(args, "max_chat_waiting", d.max_chat_waiting)
    assert admission.refusal_delay_s == expect(args, "refusal_delay_s", d.refusal_delay_s)
    assert ingress.retry.timeout_s == expect(args, "retry_timeout_s", d.retry_timeout_s)
    for key in ("max_body_bytes", "max_messages", "max_message_chars", "max_n", "max_questions"):
        assert getattr(ingress.settings, key) == expect(args, key, getattr(d, key))


def test_flat_and_nested_arguments_mean_the_same_and_unknown_ones_are_named():
    flat = AppArgs.model_validate({"device": "cpu", "chat_max_rows": 5, "chat_engine_process": False,
                                   "chat_stream_interval": 3, "decision_max_length": 100, "max_n": 3})
    nested = AppArgs.model_validate({"chat": {"device": "cpu", "engine": {"max_rows": 5, "process": False},
                                              "stream_interval": 3},
                                     "decision": {"device": "cpu", "max_length": 100}, "ingress": {"max_n": 3}})
    assert flat == nested
    assert flat.chat.engine == EngineConfig(max_rows=5, process=False)
    assert flat.decision.scorer == DecisionConfig(max_length=100)
    with pytest.raises(ValueError, match="max_rowz"):
        AppArgs.model_validate({"chat_max_rowz": 1})
    with pytest.raises(ValueError, match="unknown argument 'frobnicate'"):
        AppArgs.model_validate({"frobnicate": 1})
    with pytest.raises(ValueError, match="needs the engine in its own process"):
        AppArgs.model_validate({"chat_engine_process": False, "chat_engine_cpu_policy": "idle"})


@pytest.mark.parametrize("name", CONFIGS + ["serve_config.models.yaml"])
def test_every_shipped_config_lets_replaced_replicas_finish(name):
    """Each chat model and the Ingress drain for 300 s when a redeploy or a downscale replaces them, each decision
    model for 30 s: Serve's default of 20 s cut requests that an old Ingress held while the model it called was
    restarting (docs/deployment.md)."""
    args, deployments = shipped(name)
    kinds = {"ChatModel": "chat", "DecisionModel": "decision", "Ingress": "ingress"}
    found = {(kinds[d], opts.get("graceful_shutdown_timeout_s")) for d, opts in deployments.items() if d in kinds}
    found |= {(m["kind"], m["deployment"].get("graceful_shutdown_timeout_s")) for m in args.get("models", [])}
    assert found and found <= {("chat", 300), ("decision", 30), ("ingress", 300)}, found
    assert "ingress" in {kind for kind, _ in found}
