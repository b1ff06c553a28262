"""The engine in a child process (ProcessEngine) against the same engine on a thread (ThreadEngine)."""
import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from core.chat import EngineError, EngineFull, LLMEngine, SamplingParams, load_chat_model, save_chat_model
from core.chat.async_engine import ThreadEngine, EngineClient, StreamHold
from core.chat.engine_process import ProcessEngine, start_engine
from core.chat.protocol import (EngineConfig, EngineDied, GenerateRequest, SamplingParams as Params, EngineStart, StreamError,
                                TokenEvent, decode_message)
from tests.conftest import tiny_model, unreadable_records
from tests.waiting import until, wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("engine-process") / "chat"
    save_chat_model(str(path), tiny_model("nanochat", tokenizer, sequence_len=512), tokenizer)
    return str(path)


@pytest.fixture(scope="module")
def engine(checkpoint):
    pe = ProcessEngine(EngineStart(checkpoint, "cpu", EngineConfig(max_rows=4, torch_threads=1, dtype="float32")))
    yield pe
    pe.shutdown()
    assert pe.proc.returncode is not None


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def stream_tokens(front, prompt, params):
    out: dict[int, list] = {}
    async for batch in front.generate(prompt, params):
        for ev in batch:
            out.setdefault(ev.index, []).append((ev.token, ev.text, ev.finish_reason))
    return out


REQUESTS = [([5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)),
            ([9, 10], SamplingParams(max_tokens=9, temperature=0.0)),
            ([11, 12, 13], SamplingParams(max_tokens=7, temperature=0.8, top_k=20, seed=7, n=2)),
            ([14] * 30, SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=3))]


async def all_at_once(front):
    return await asyncio.gather(*(stream_tokens(front, p, params) for p, params in REQUESTS))


async def one_by_one(front):
    return [await stream_tokens(front, p, params) for p, params in REQUESTS]


def thread_reference(checkpoint, device, how):
    """REQUESTS run `how` (all_at_once or one_by_one) through the engine on a thread of this process."""
    model, tok, _ = load_chat_model(checkpoint, device)
    threaded = ThreadEngine(LLMEngine(model, tok, max_rows=4))
    try:
        return run(how(threaded))
    finally:
        threaded.shutdown()


def test_the_engine_process_runs_a_large_model_packed(tmp_path, tokenizer):
    """The service's engine process packs a model whose layers are large enough (core/chat/packed.py), and
    says so: a replica that silently fell back to torch's F.linear would fail here."""
    from core.chat.packed import MIN_WEIGHT

    path = str(tmp_path / "wide")
    model = tiny_model("gpt2", tokenizer, n_layer=1, n_head=6, n_kv_head=6, n_embd=384, std=0.2)
    assert 4 * 384 * 384 >= MIN_WEIGHT                  # its MLP's layers are over the packing limit
    save_chat_model(path, model, tokenizer)
    pe = ProcessEngine(EngineStart(path, "cpu", EngineConfig(max_rows=4, torch_threads=1, dtype="float32")))
    try:
        assert pe.linear == "onednn-packed"
        tokens = run(stream_tokens(pe, [5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
    finally:
        pe.shutdown()
    plain = LLMEngine(model, tokenizer, max_rows=4, packed_linear=False)
    plain.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), "x")
    expected = []
    while plain.has_work():
        expected += [ev.token for ev in plain.step() if ev.token is not None]
    assert [t for t, _, _ in tokens[0] if t is not None] == expected and len(expected) == 6


def test_same_streams_as_the_thread_engine(engine, checkpoint):
    """Concurrent seeded and greedy requests give the same tokens, text and endings in both fronts."""
    reference = thread_reference(checkpoint, "cpu", all_at_once)
    got = run(all_at_once(engine))
    assert got == reference
    assert [len(r) for r in got] == [1, 1, 2, 1] and len(got[0][0]) == 13   # 12 tokens, then the end


def test_refusals_are_raised_from_generate(engine, checkpoint):
    async def first(prompt, params, front=engine):
        async for batch in front.generate(prompt, params):
            return batch

    with pytest.raises(EngineError, match="empty"):
        run(first([], SamplingParams()))
    with pytest.raises(EngineError, match="context"):
        run(first([3] * 600, SamplingParams()))
    with pytest.raises(EngineError, match="exceeds"):
        run(first([3], SamplingParams(n=5)))
    # a full waiting queue: one row, one waiting slot, three requests
    small = ProcessEngine(EngineStart(checkpoint, "cpu", EngineConfig(max_rows=1, max_waiting=1)))

    async def crowd():
        hold = small.generate([1, 2], SamplingParams(max_tokens=400, ignore_eos=True))
        await hold.__anext__()                                  # running: holds the only row
        queued = small.generate([1, 2], SamplingParams(max_tokens=2))
        task = asyncio.ensure_future(queued.__anext__())        # waits for the row
        await until(lambda: len(small._queues) == 2, 30, "the second request was not sent")   # its Add goes first
        try:
            await first([1, 2], SamplingParams(max_tokens=2), small)
        finally:
            await hold.aclose()
            await task
            await queued.aclose()

    try:
        with pytest.raises(EngineFull):
            run(crowd())
    finally:
        small.shutdown()


def test_leaving_a_stream_frees_its_rows(engine):
    async def main():
        agen = engine.generate([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        await agen.__anext__()
        busy = await until(lambda: (s := engine.stats()).running and s, 10,   # the child reports while it works
                           "the child never reported the stream running")
        await agen.aclose()
        await until(lambda: not engine.stats().rows_used, 10, "the stream's row was not freed", 0.05)
        return busy, engine.stats()

    busy, idle = run(main())
    assert busy.running == 1 and busy.rows_used == 1
    assert idle.running == 0 and idle.rows_used == 0


def test_a_dead_engine_ends_open_streams(checkpoint):
    pe = ProcessEngine(EngineStart(checkpoint, "cpu", EngineConfig(max_rows=2)))

    async def main():
        agen = pe.generate([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        await agen.__anext__()
        os.kill(pe.pid, signal.SIGKILL)                         # the child this test started, by its pid
        async for _ in agen:
            pass

    try:
        with pytest.raises(EngineDied):
            run(main(), timeout=30)
        assert not pe.alive()
        with pytest.raises(EngineDied):
            run(stream_tokens(pe, [1, 2], SamplingParams(max_tokens=2)))
    finally:
        pe.shutdown()


def test_an_unreadable_record_ends_open_streams_instead_of_hanging(checkpoint, monkeypatch):
    """A record the parent cannot read (a child started from other code than the parent's) ends the reader:
    the open stream fails with EngineDied, the engine reports itself dead, and nothing hangs."""
    from core.chat import protocol

    pe = ProcessEngine(EngineStart(checkpoint, "cpu", EngineConfig(max_rows=2)))
    try:
        unreadable_records(monkeypatch, protocol, "Stats")    # sent after the first step
        with pytest.raises(EngineDied):
            run(stream_tokens(pe, [1, 2, 3], SamplingParams(max_tokens=4)), timeout=60)
        assert not pe.alive()
    finally:
        monkeypatch.undo()
        pe.shutdown()


def test_child_exits_when_its_parent_dies(checkpoint, tmp_path):
    """A replica killed outright must not leave its engine process behind."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from core.chat.engine_process import ProcessEngine
        from core.chat.protocol import EngineConfig, EngineStart
        pe = ProcessEngine(EngineStart({checkpoint!r}, "cpu", EngineConfig(max_rows=1)))
        print(pe.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        parent.kill()                                           # by its pid: SIGKILL, no cleanup code runs
        parent.wait(timeout=30)
        wait_until(lambda: not alive(child), 20, "the engine process outlived its killed parent", 0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def per_choice(records) -> dict:
    """A stream's records put end to end per choice: (token ids, text by segment, finish reasons)."""
    out = {}
    for d in records:
        if isinstance(d, StreamError):
            out.setdefault("error", []).append(d)
            continue
        tokens, text, finish = out.setdefault(d.index, ([], [], []))
        tokens += d.tokens
        text.append((d.segment, d.text))
        finish += [d.finish_reason] if d.finish_reason else []
    return {k: v if k == "error" else (v[0], "".join(t for seg, t in v[1] if seg == "text"), v[2])
            for k, v in out.items()}


async def chat_messages(model, request) -> list[list]:
    return [decode_message(m) async for m in model.generate(request)]


def test_chat_deployment_same_stream_with_either_front(checkpoint):
    """The chat deployment class (outside Serve) streams the same tokens and text whether its engine runs in a
    child process or on a thread, and turns a refused request into an error record either way."""
    from deployments.chat import ChatModel
    from deployments.settings import ChatSettings

    messages = ({"role": "user", "content": "hello how are you"},)
    request = GenerateRequest(Params(max_tokens=10, temperature=1.0, seed=11, n=2), messages=messages)
    too_many = GenerateRequest(Params(n=9), messages=messages)
    got = {}
    for engine_process in (True, False):
        model = ChatModel.func_or_class(ChatSettings(checkpoint=checkpoint, device="cpu", max_rows=4,
                                                     process=engine_process))
        try:
            assert type(model.engine).__name__ == ("ProcessEngine" if engine_process else "ThreadEngine")
            got[engine_process] = (per_choice(r for m in run(chat_messages(model, request)) for r in m),
                                   run(chat_messages(model, too_many)))
        finally:
            model.engine.shutdown()
    assert got[True] == got[False]
    streamed, refused = got[True]
    assert [len(streamed[i][0]) for i in (0, 1)] == [10, 10]
    assert [streamed[i][2] for i in (0, 1)] == [["length"], ["length"]]
    assert refused == [[refused[0][0]]] and isinstance(refused[0][0], StreamError)
    assert refused[0][0].type == "invalid_request_error" and "n=9" in refused[0][0].message


def test_stream_interval_groups_tokens_after_the_first(checkpoint):
    """stream_interval=4 with the real engine: the stream, put end to end per choice, is that of
    stream_interval=1, and once a message has shown text, each later one carries at least 4 tokens or ends a
    sample. (How the events before the first text are split depends on timing.)"""
    from deployments.chat import ChatModel
    from deployments.settings import ChatSettings

    request = GenerateRequest(Params(max_tokens=11, temperature=1.0, seed=5, n=2),
                              messages=({"role": "user", "content": "hello how are you"},))
    got = {}
    for interval in (1, 4):
        model = ChatModel.func_or_class(ChatSettings(checkpoint=checkpoint, device="cpu", max_rows=4,
                                                     stream_interval=interval))
        try:
            got[interval] = run(chat_messages(model, request))
        finally:
            model.engine.shutdown()
    flat = lambda messages: per_choice(r for m in messages for r in m)   # noqa: E731
    assert flat(got[4]) == flat(got[1])
    tokens = [sum(len(d.tokens) for d in m) for m in got[4]]
    assert sum(tokens) == 22
    shown = next(i for i, m in enumerate(got[4]) if any(d.text and d.segment == "text" for d in m))
    assert all(t >= 4 or any(d.finish_reason for d in m) for t, m in zip(tokens[shown + 1:], got[4][shown + 1:]))
    with pytest.raises(ValueError, match="stream_interval"):
        ChatSettings(checkpoint=checkpoint, device="cpu", stream_interval=0)


def test_chat_deployment_on_the_token_channel(checkpoint):
    """With a channel ticket, the chat deployment sends its first message through its call, marked OnChannel,
    and the rest, then END, on the channel: put end to end they are the stream without a ticket. When the
    channel breaks under it mid-stream, the call ends with a message the Ingress takes for a lost replica."""
    from core.chat.protocol import ENGINE_STOPPED_CODE, OnChannel
    from deployments.channel import END, ChannelServer
    from deployments.chat import ChatModel
    from deployments.settings import ChatSettings

    request = GenerateRequest(Params(max_tokens=12, temperature=1.0, seed=7, n=2),
                              messages=({"role": "user", "content": "hello how are you"},))

    async def on_channel(model, request, cut: bool = False):
        server = ChannelServer()
        ticket, sink = await server.open()
        through_call = []
        async for m in model.generate(msgspec.structs.replace(request, channel=ticket)):
            through_call.append(decode_message(m))
            if cut and len(through_call) == 1:
                await server.stop()                           # the connection goes after the first message
        rest = []
        while not cut and rest[-1:] != [END]:                 # the channel's frames, to the end
            rest.append(await sink.get())
        rest += sink.items
        await server.stop()
        return through_call, rest

    model = ChatModel.func_or_class(ChatSettings(checkpoint=checkpoint, device="cpu", max_rows=4, process=False))
    try:
        plain = run(chat_messages(model, request))
        through_call, rest = run(on_channel(model, request))
        long = GenerateRequest(Params(max_tokens=400, temperature=1.0, seed=7), messages=request.messages)
        cut_call, cut_rest = run(on_channel(model, long, cut=True))
    finally:
        model.engine.shutdown()
    assert isinstance(through_call[0][0], OnChannel) and len(through_call) == 1 and rest[-1] == END
    channelled = [through_call[0][1:]] + [decode_message(m) for m in rest[:-1]]
    assert per_choice(r for m in channelled for r in m) == per_choice(r for m in plain for r in m)
    assert len(cut_call) == 2 and END not in cut_rest
    (lost,) = cut_call[1]
    assert isinstance(lost, StreamError) and lost.code == ENGINE_STOPPED_CODE


class DirectClient(EngineClient):
    """An engine client whose events the test hands over itself (`_deliver`), on a clock it sets."""

    max_rows = 4
    linear = attention = dtype = decode = "none"

    def __init__(self, hold):
        super().__init__(hold=hold)
        self.now = 100.0
        self.clock = lambda: self.now

    def _submit(self, prompt, params, rid, resume):
        self.rid = rid

    def _cancel(self, rid):
        pass

    def stats(self):
        return None

    def alive(self):
        return True

    def shutdown(self):
        pass


def test_stream_hold_partition():
    """The hold in the engine client, step by step: steps without visible text go at once, the step with the
    first text too; then groups of 3 tokens, or (with a time) whatever is held once that long has passed since
    the last wake; a calculator part closing inside a group does not end it; a sample's end goes at once with
    whatever is held; so does a failure, after the events held; a reader that falls behind gets every
    delivery that arrived meanwhile in one."""
    def ev(token, text="", segment="text", closes=False, finish=None):
        return TokenEvent("r", 0, token, text, segment, False, closes, finish, 5, 0)

    steps = [[ev(1)], [ev(2)], [ev(3, "Hi")], [ev(4, " a")], [ev(5, "b")], [ev(6, "c")], [ev(7, "", "python")],
             [ev(8, "1+1", "python", closes=True)], [ev(9, "d")], [ev(10, "e")], [ev(None, "", finish="stop")]]

    async def play(hold, steps, fail=None, seconds_per_step=0.0, behind=()):
        client = DirectClient(hold)
        stream = client.generate([1], Params(max_tokens=20))
        got, pending = [], asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        for k, step in enumerate(steps):
            client._deliver([msgspec.structs.replace(e, request_id=client.rid) for e in step])
            client.now += seconds_per_step
            if k in behind:
                continue                         # the reader does not run before the next step
            for _ in range(3):
                await asyncio.sleep(0)
            if pending.done():
                got.append([e.token for e in pending.result()])
                pending = asyncio.ensure_future(stream.__anext__())
        if fail is not None:
            client._fail([client.rid], fail)
        try:
            while True:
                got.append([e.token for e in await pending])
                pending = asyncio.ensure_future(stream.__anext__())
        except StopAsyncIteration:
            return got
        except EngineDied:
            return got + ["died"]

    assert run(play(StreamHold(3), steps)) == [[1], [2], [3], [4, 5, 6], [7, 8, 9], [10, None]]
    assert run(play(StreamHold(), steps)) == [[t] for t in range(1, 11)] + [[None]]
    assert run(play(StreamHold(100, 0.02), steps, seconds_per_step=0.01)) == [[1], [2], [3], [4, 5], [6, 7], [8, 9],
                                                                              [10, None]]
    assert run(play(StreamHold(3), steps[:5], fail=EngineDied("gone"))) == [[1], [2], [3], [4, 5], "died"]
    assert run(play(StreamHold(), steps, behind={4, 5, 6})) == [[1], [2], [3], [4], [5, 6, 7, 8], [9], [10],
                                                                [None]]
    with pytest.raises(ValueError):
        StreamHold(0)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_idle_cpu_policy(checkpoint):
    """cpu_policy="idle": every thread of the engine process runs under SCHED_IDLE (or, where the system refuses
    it, the engine says so and serves anyway), and the streams are the same as on a thread of this process. A
    policy needs the child process; an unknown one is refused."""
    reference = thread_reference(checkpoint, "cpu", one_by_one)
    pe = ProcessEngine(EngineStart(checkpoint, "cpu", EngineConfig(max_rows=4, torch_threads=1, cpu_policy="idle", dtype="float32")))
    try:
        assert run(one_by_one(pe)) == reference
        probe = subprocess.run([sys.executable, "-c", "import os; os.sched_setscheduler(0, os.SCHED_IDLE, "
                                "os.sched_param(0))"], capture_output=True)
        if probe.returncode == 0:
            assert pe.info.cpu_policy == "idle"
            threads = os.listdir(f"/proc/{pe.pid}/task")
            assert threads and all(os.sched_getscheduler(int(t)) == os.SCHED_IDLE for t in threads)
        else:                                                   # a sandbox that forbids it: the engine serves anyway
            assert pe.info.cpu_policy.startswith("normal (idle refused")
    finally:
        pe.shutdown()
    assert os.sched_getscheduler(0) != os.SCHED_IDLE           # this process is untouched
    with pytest.raises(ValueError, match="own process"):
        EngineConfig(cpu_policy="idle", process=False)
    with pytest.raises(ValueError, match="cpu_policy"):
        EngineConfig(cpu_policy="realtime")


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_refused_cpu_policy_is_reported_not_fatal(monkeypatch):
    from core.chat import engine_process

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(engine_process.os, "sched_setscheduler", refuse)
    assert engine_process.set_cpu_policy("idle") == "normal (idle refused: [Errno 1] Operation not permitted)"
    assert engine_process.set_cpu_policy("normal") == "normal"


@pytest.mark.gpu
def test_cuda_process_engine_matches_thread_engine(checkpoint):
    """On CUDA (bf16) the child process owns the GPU; one request at a time, so both fronts run the same shapes
    and must give the same tokens; then all requests at once must all finish."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    reference = thread_reference(checkpoint, "cuda", one_by_one)
    pe = ProcessEngine(EngineStart(checkpoint, "cuda", EngineConfig(max_rows=4)))
    try:
        assert pe.info.device.startswith("cuda")
        assert run(one_by_one(pe)) == reference
        together = run(all_at_once(pe))
        assert [sorted(r) for r in together] == [sorted(r) for r in reference]
        assert [[out[-1][2] for out in r.values()] for r in together] == \
            [[out[-1][2] for out in r.values()] for r in reference]
    finally:
        pe.shutdown()


def test_the_serving_replicas_import_no_torch():
    """Both models run in child processes: the replicas' own code (deployments.app and what it imports) loads no
    torch and no transformers, so a replica starts in a second, not three, and holds no copy of them."""
    out = subprocess.run([sys.executable, "-c", "import sys, deployments.app; "
                          "print([m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules])"],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
