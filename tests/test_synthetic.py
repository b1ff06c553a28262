"""The synthetic engine (chat_engine: synthetic): no model, real tokens, the engine's scheduling and output side."""
import asyncio

import pytest

from core.chat.async_engine import ThreadEngine
from core.chat.engine_process import ProcessEngine
from core.chat.protocol import EngineConfig, EngineError, SamplingParams, EngineStart
from core.chat.synthetic import TEXT, SyntheticEngine
from deployments.settings import AppArgs

SEQ = 512


@pytest.fixture
def synthetic(tokenizer):
    return SyntheticEngine(tokenizer, SEQ, tokenizer.vocab_size, EngineConfig(backend="synthetic", max_rows=8, synthetic_step_s=0))


def drain(engine, limit=10_000):
    """Step until idle; -> {request id: its events}, and the steps taken."""
    out, steps = {}, 0
    while engine.has_work() and steps < limit:
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev)
        steps += 1
    return out, steps


def tokens(events, index=0):
    return [ev.token for ev in events if ev.index == index and ev.token is not None]


def test_seeded_tokens_come_from_the_text_and_repeat(synthetic, tokenizer):
    p = SamplingParams(max_tokens=40, seed=7)
    synthetic.add_request([1, 2, 3], p, "a")
    synthetic.add_request([1, 2, 3], p, "b")
    synthetic.add_request([1, 2, 3], SamplingParams(max_tokens=40, seed=8), "c")
    out, _ = drain(synthetic)
    a, b, c = tokens(out["a"]), tokens(out["b"]), tokens(out["c"])
    assert len(a) == 40 and a == b and a != c
    text = tokenizer.encode(TEXT)
    start = next(i for i in range(len(text)) if [text[(i + j) % len(text)] for j in range(40)] == a)
    assert start >= 0
    assert "".join(ev.text for ev in out["a"]) == tokenizer.decode(a)    # the output side decoded them
    assert out["a"][-1].finish_reason == "length" and out["a"][-1].completion_tokens == 40


def test_one_token_per_row_per_step_and_rows_bound_concurrency(synthetic):
    for i in range(10):                           # 8 rows: two requests wait for rows
        synthetic.add_request([5, 6], SamplingParams(max_tokens=5), f"r{i}")
    per_step = []
    while synthetic.has_work():
        per_step.append(sum(1 for ev in synthetic.step() if ev.token is not None))
    assert max(per_step) == 8
    assert per_step[:5] == [8] * 5 and sum(per_step) == 50


def test_n_samples_have_their_own_tokens(synthetic):
    synthetic.add_request([1, 2], SamplingParams(max_tokens=12, n=4, seed=3), "n")
    out, _ = drain(synthetic)
    runs = [tokens(out["n"], i) for i in range(4)]
    assert all(len(r) == 12 for r in runs) and len({tuple(r) for r in runs}) == 4
    assert sorted(ev.index for ev in out["n"] if ev.finish_reason) == [0, 1, 2, 3]


def test_resume_continues_the_run(synthetic):
    p = SamplingParams(max_tokens=30, seed=11)
    synthetic.add_request([9, 9, 9], p, "full")
    full = tokens(drain(synthetic)[0]["full"])
    synthetic.add_request([9, 9, 9], p, "cont", resume=full[:12])
    out = drain(synthetic)[0]["cont"]
    assert tokens(out) == full[12:]
    assert out[-1].completion_tokens == 30


def test_stop_strings_logprobs_and_prompt_logprobs(synthetic, tokenizer):
    p = SamplingParams(max_tokens=60, seed=1, logprobs=3, stop=("e",))
    synthetic.add_request([1, 2, 3], p, "s")
    out = drain(synthetic)[0]["s"]
    assert out[-1].finish_reason == "stop" and "e" not in "".join(ev.text for ev in out)
    sampled = [ev for ev in out if ev.token is not None]
    assert all(ev.logprob is not None and len(ev.top_logprobs) == 3 and ev.top_logprobs[0][0] == ev.token
               for ev in sampled)
    synthetic.add_request([4, 5, 6], SamplingParams(max_tokens=0, prompt_logprobs=1), "score")
    (finish,) = drain(synthetic)[0]["score"]
    assert finish.finish_reason == "length" and [t for t, _, _ in finish.prompt_logprobs] == [4, 5, 6]
    assert finish.prompt_logprobs[0][1] is None and finish.prompt_logprobs[1][1] is not None


def test_refuses_what_needs_a_model_and_aborts(synthetic):
    with pytest.raises(EngineError, match="structured output"):
        synthetic.add_request([1], SamplingParams(grammar='start: "a"'))
    with pytest.raises(EngineError, match="context"):
        synthetic.add_request([1] * SEQ, SamplingParams())
    synthetic.add_request([1, 2], SamplingParams(max_tokens=100), "x")
    synthetic.step()
    synthetic.abort("x")
    out, _ = drain(synthetic)
    assert out["x"][-1].finish_reason == "abort" and not synthetic.has_work()


def test_steps_are_paced(tokenizer, monkeypatch):
    """The step time is a sleep before each step, on the engine's clock (a fake one here, so nothing is timed):
    back-to-back steps sleep out the rest of the step, and a late step runs at once without making the next
    one early."""
    class Clock:
        now, slept = 1000.0, []

        def monotonic(self):
            return self.now

        def sleep(self, seconds):
            self.slept.append(round(seconds, 6))
            self.now += seconds

    clock = Clock()
    monkeypatch.setattr("core.chat.synthetic.time", clock)
    engine = SyntheticEngine(tokenizer, SEQ, tokenizer.vocab_size, EngineConfig(backend="synthetic", synthetic_step_s=0.005))
    engine.add_request([1], SamplingParams(max_tokens=20), "p")
    for _ in range(3):
        engine.step()
    clock.now += 0.001                        # work between steps shortens the next sleep
    engine.step()
    clock.now += 0.050                        # a late step: no sleep, and the next is a full step later
    engine.step()
    engine.step()
    assert clock.slept == [0.005, 0.005, 0.004, 0.005]


def test_settings_select_the_synthetic_engine():
    chat = AppArgs.model_validate({"chat_engine": "synthetic", "chat_synthetic_step_s": 0.002, "chat_max_rows": 64}).chat
    assert chat.engine.backend == "synthetic" and chat.engine.synthetic_step_s == 0.002 and chat.engine.max_rows == 64
    assert AppArgs.model_validate({}).chat.engine.backend == "model"
    with pytest.raises(ValueError, match="synthetic"):
        AppArgs.model_validate({"chat_engine": "fast"})


def test_process_engine_runs_the_synthetic_engine_without_torch(chat_checkpoint):
    """Behind the engine process boundary, as the service runs it: no torch in the engine process, and the
    stream is the same as the engine's own on a thread."""
    config = EngineConfig(backend="synthetic", max_rows=4, synthetic_step_s=0)
    params = SamplingParams(max_tokens=25, seed=5, n=2)

    async def collect(client):
        evs = []
        async for batch in client.generate([1, 2, 3], params):
            evs += batch
        return evs

    pe = ProcessEngine(EngineStart(chat_checkpoint, None, config))
    try:
        assert pe.info.device == "synthetic" and pe.info.torch_threads == 0
        with open(f"/proc/{pe.pid}/maps") as f:
            assert "libtorch" not in f.read()
        remote = asyncio.run(asyncio.wait_for(collect(pe), 30))
    finally:
        pe.shutdown()
    from core.chat import load_chat_tokenizer
    tok, cfg = load_chat_tokenizer(chat_checkpoint)
    local = ThreadEngine(SyntheticEngine(tok, cfg.sequence_len, cfg.vocab_size, config))
    try:
        here = asyncio.run(asyncio.wait_for(collect(local), 30))
    finally:
        local.shutdown()
    strip = lambda evs: sorted((ev.index, ev.completion_tokens, ev.token or -1, ev.text,  # noqa: E731
                                ev.finish_reason or "") for ev in evs)
    assert strip(remote) == strip(here) and len(tokens(remote, 1)) == 25
