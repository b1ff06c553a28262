"""Shared fixtures: a tokenizer trained here with rustbpe and tiny random-weight chat models. No downloads."""
from __future__ import annotations

import os
import random

from cluster.cli import THROUGHPUT

# The request path production runs (docs/configuration.md): set before anything imports Ray, whose Serve constants are read
# once at import, so the in-process Serve of the tests and every Ray worker it starts agree.
for _key, _value in THROUGHPUT.items():
    os.environ.setdefault(_key, _value)
# On that path Ray keeps a stopping Ingress replica reachable for 30 s so that load balancers in front of it can
# deregister it; in the tests the only party in front is Serve's proxy or HAProxy on the same host, which learns of
# the stop within a second, so each replaced or deleted Ingress would only sit out the window (a minute of every
# service's teardown, half a minute per stop in the stop test). Inherited by every Ray process the tests start.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
# One torch thread in the test process and the processes it starts (unless a test or a config sets its own): the
# models here are tiny, and on a 2-core machine with one core taken by other work, two threads made the in-process
# model tests twice as slow (each parallel region waits for the thread that shares the busy core).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from core.chat import ChatDefaults, ChatModelConfig, ChatTokenizer, build_model, save_chat_model
from core.chat.model import init_weights
from core.chat.tokenizer import train_tokenizer
from tests.waiting import wait_until

WORDS = ("the cat dog sat on a mat red blue green what is capital of france paris hello how are you "
         "number plus minus times answer question river mountain city country small large").split()
UNICODE = ("héllo", "naïve", "日本語", "café", "привет", "😀", "Zürich", "ελληνικά")


def corpus(n: int = 3000, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        if rng.random() < 0.2:
            words.append(rng.choice(UNICODE))
        yield " ".join(words) + rng.choice([".", "?", "!", "\n"])


def make_tokenizer(vocab_size: int = 512) -> ChatTokenizer:
    return train_tokenizer(corpus(), vocab_size)


@pytest.fixture(scope="session")
def tokenizer() -> ChatTokenizer:
    return make_tokenizer()


# nanochat's architecture as its current code trains it (nanochat_versions.py's newest version), with a short
# window that the tests' prompts pass: "modern" in tiny_config
MODERN = dict(arch="nanochat", n_layer=4, rope_theta=100000.0, qk_scale=1.2, window_pattern="SSSL", short_window=16,
              residual_lambdas=True, value_embeds=True, smear=True, backout=True)


def tiny_config(arch: str, tokenizer: ChatTokenizer, **kw) -> ChatModelConfig:
    """arch: nanochat (its release architecture), modern (its current one) or gpt2."""
    base = dict(arch=arch, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4,
                n_kv_head=2 if arch in ("nanochat", "modern") else 4, n_embd=64, sequence_len=256)
    if arch == "modern":
        base.update(MODERN)
    base.update(kw)
    return ChatModelConfig(**base)


def tiny_model(arch: str, tokenizer: ChatTokenizer, seed: int = 0, std: float = 0.5, **kw):
    # a large init std gives peaked, varied next-token distributions, so greedy runs are not full of ties
    torch.manual_seed(seed)
    return init_weights(build_model(tiny_config(arch, tokenizer, **kw)), seed=seed, std=std).eval()


def assert_same_model(a, b, ids) -> None:
    """The same weights (exactly) and the same logits on `ids` up to rounding: a model an engine has packed
    (core/chat/packed.py) computes its products another way than a freshly loaded one."""
    ours, ref = a.state_dict(), b.state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    with torch.no_grad():
        assert torch.allclose(a(ids), b(ids), atol=1e-5)


@pytest.fixture(scope="session")
def nanochat_model(tokenizer):
    return tiny_model("nanochat", tokenizer)


@pytest.fixture(scope="session")
def modern_model(tokenizer):
    # seed 2: a draw whose numbers in test_structured's schema runs end within its 120 tokens at temperature 1
    # (seeds 0 and 1 write 200-character numbers there: random weights' taste, not a grammar fault)
    return tiny_model("modern", tokenizer, seed=2)


@pytest.fixture(params=["nanochat_model", "modern_model"], ids=["nanochat-release", "nanochat-current"])
def any_nanochat(request):
    """The engine's properties on both nanochat architectures: its release and its current code's."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def gpt2_model(tokenizer):
    return tiny_model("gpt2", tokenizer, seed=1, std=0.2)


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory, tokenizer, nanochat_model):
    path = tmp_path_factory.mktemp("chat_ckpt")
    fewshot = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello how are you"}]
    save_chat_model(str(path), nanochat_model, tokenizer, ChatDefaults(fewshot=fewshot, max_tokens=32))
    return str(path)


@pytest.fixture(scope="session")
def serve_url():
    """One in-process Ray instance and Serve, on a free loopback port, for the modules that run applications on it
    (test_serve.py, test_web.py): each module runs its applications and deletes them when it is done. Started once
    for the session (a start and a shutdown take half a minute on a busy 2-core host); the tests that use it run
    last (pytest_collection_modifyitems), so it is stopped right after them."""
    import ray
    from ray import serve

    from cluster.local_cluster import free_port

    port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def delete_apps(*names: str, timeout: float = 120) -> None:
    """Delete Serve applications together and wait until they are gone: each delete drains its replicas and stops
    their model processes (seconds each), so one after another they add up."""
    from ray import serve

    for name in names:
        serve.delete(name, _blocking=False)
    left = lambda: set(names) & set(serve.status().applications)   # noqa: E731
    wait_until(lambda: not left(), timeout, lambda: f"applications not deleted: {sorted(left())}", 0.2)


@pytest.fixture(scope="session", autouse=True)
def background_soak(request, tmp_path_factory):
    """When tests/test_operations.py's soak test is selected: the README's service and the CI soak against it,
    started as the session begins and run in a thread beside the unit tests (tests/readme_service.py,
    BackgroundSoak), for test_operations.py to take over. None otherwise."""
    from tests.readme_service import SOAK_TEST, BackgroundSoak

    if not any(item.nodeid.endswith(SOAK_TEST) for item in request.session.items):
        yield None
        return
    # the engine's kernels built here first: the service's replica finds them built instead of compiling them
    # within its start's timeout, beside unit tests that compile them too (a fresh CI machine)
    from core.chat.extensions import build_all

    build_all()
    run = BackgroundSoak(tmp_path_factory.mktemp("operations"))
    try:
        yield run
    finally:
        run.close()


def run_order(item) -> tuple[bool, bool, bool]:
    """Unit tests first (the background soak runs beside them), then test_operations.py's tests on the README's
    service (the soak's report, then its service's other checks and its stops), then the other tests that start
    Ray, the ones on the shared in-process Serve (serve_url) last, so that its Ray instance, torn down at the end
    of the session, never idles beside the other tests. Each group keeps its order."""
    starts_ray = item.get_closest_marker("serve") is not None
    return (starts_ray, starts_ray and not item.nodeid.split("::")[0].endswith("test_operations.py"),
            "serve_url" in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config, items):
    items.sort(key=run_order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def unreadable_records(monkeypatch, module, name: str) -> None:
    """From now on this process cannot read the records a child sends as `module.name` (unpickling looks the class
    up there): what a child started from other code than its parent's would send."""
    class Other:
        def __init__(self, *fields):
            raise TypeError(f"a {name} record of other code")
    monkeypatch.setattr(module, name, Other)
