"""The README's serve command as a subprocess, for tests/test_operations.py: start it, check that it answers and
listens only where it should, stop it each way an operator or a supervisor would, and see what is left."""
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from bench.soak import soak
from cluster.local_cluster import default_sigint, free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent


def readme_serve_command() -> tuple[dict, list[str]]:
    """The environment assignments and arguments of the start in the README's first command ($PWD: the root)."""
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if "startlux serve" in x
                and x.startswith("python3 -m venv"))
    words = shlex.split(line.split("&&")[-1].replace("$PWD", str(ROOT)))
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    return env, [w for w in words if "=" not in w]


def session_members(sid: int) -> list[int]:
    """Processes in session `sid` (the one a `start_new_session` child leads), read from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(entry))
    return out


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s local address (little-endian words) -> its text form."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listening_sockets(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, command, address, port) of every listening TCP socket the processes hold, from /proc."""
    listeners = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A":                                   # TCP_LISTEN
                addr, port = f[1].rsplit(":", 1)
                listeners[f[9]] = (_address(addr), int(port, 16))
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listeners:
                out.append((pid, comm(pid), *listeners[target[8:-1]]))
    return sorted(set(out))


def loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1")


class ReadmeService:
    """The README's `startlux serve` in its own session (its id is the pid, which `serve run` keeps: the command
    execs it), on ports fixed for every start."""

    def __init__(self, tmp_path: Path, serve_args: tuple[str, ...] = (), config: str = "serve_config.cpu.yaml"):
        """serve_args: options of `startlux serve` after the config (`--chat-checkpoint DIR`, say); config: the
        repository's config to start (its port changed)."""
        from cluster.cli import ray_defaults

        env, argv = readme_serve_command()
        assert argv == [".venv/bin/startlux", "serve"] and not env, (env, argv)
        ray = ray_defaults()        # what the command sets where the environment does not
        assert ray["RAY_SERVE_ENABLE_HA_PROXY"] == "1"   # HAProxy answers on the port, in front of the Ingress
        assert Path(ray["RAY_SERVE_HAPROXY_BINARY_PATH"]).name == "startlux-haproxy"
        # HAProxy's own listeners (metrics, stats) and Serve's fallback proxy on free ports, not their fixed defaults
        self.side_ports = {"RAY_SERVE_HAPROXY_METRICS_PORT": free_port(), "RAY_SERVE_HAPROXY_STATS_PORT": free_port(),
                           "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": free_port()}
        # After its GCS is gone, `serve run` (a Ray driver) and the dashboard wait Ray's reconnect timeout (60 s)
        # before they exit; the stop test stops the cluster under them once, and 5 s of that are enough here (the
        # timeout counts only while the GCS cannot be reached at all, never while a busy host merely slows it)
        self.env = env | {k: str(v) for k, v in self.side_ports.items()}
        self.env["RAY_gcs_rpc_server_reconnect_timeout_s"] = "5"
        # for a stop that leaves serve run behind: its log is written as it goes, and SIGABRT (wait_gone) makes
        # it print where each of its threads is
        self.env |= {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
        assert os.access(ray["RAY_SERVE_HAPROXY_BINARY_PATH"], os.X_OK)    # installed by `pip install -e .`
        cfg = yaml.safe_load((ROOT / config).read_text())
        self.port = free_port()
        cfg["http_options"]["port"] = self.port
        self.config = tmp_path / config
        self.config.write_text(yaml.safe_dump(cfg))
        self.tmp_path, self.url, self.proc = tmp_path, f"http://127.0.0.1:{self.port}", None
        self.serve_args = list(serve_args)
        self.start_s: list[float] = []          # how long each start took, to /healthz answering

    def start(self, timeout: float = 180) -> float:
        """Start `serve run` and wait for /healthz; the seconds it took."""
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Start `serve run`, without waiting (BackgroundSoak launches before it starts its thread: preexec_fn runs
        Python in the forked child, safe only while no other thread of ours can hold a lock the child needs)."""
        self.log_path = self.tmp_path / f"serve.{len(self.start_s) + 1}.log"
        self.log = open(self.log_path, "wb")
        self.launched = time.monotonic()
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "startlux"), "serve", str(self.config),
                                      *self.serve_args], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                     start_new_session=True, preexec_fn=default_sigint)

    def wait_ready(self, timeout: float = 180) -> float:
        """Wait for the launched `serve run` to answer /healthz (failing at once if it exits); the seconds since
        its launch."""
        def answers() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve run exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(answers, timeout, lambda: f"start {len(self.start_s) + 1} did not answer: "
                                             f"{self.log_path.read_text()[-3000:]}", 0.5)
        self.start_s.append(time.monotonic() - self.launched)
        return self.start_s[-1]

    def members(self) -> list[int]:
        return session_members(self.proc.pid)

    def wait_gone(self, timeout: float) -> list[tuple[int, str]]:
        """Wait until nothing of this run is left; what was left at the deadline, each ended by its pid."""
        wait_until(lambda: not self.members(), timeout, interval=0.2, fail=False)
        left = [(pid, comm(pid)) for pid in self.members()]
        self.stuck = ""                                # for the failure's message: the end of serve run's log
        if left:
            if self.proc.poll() is None:               # serve run itself did not end: where is it?
                self.proc.send_signal(signal.SIGABRT)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            self.stuck = self.log_path.read_text(errors="replace")[-6000:]
        for pid, _ in left:                            # what it started and left behind, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()
        return left

    def stop(self) -> None:
        """serve run's own clean shutdown, as Ctrl-C in its terminal (SIGINT to its process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)


# The CI version of bench/soak.py's run (tests/test_operations.py): two minutes at a fixed, modest rate after 32
# decisions as fast as they are answered
CI_SOAK = {"minutes": 2, "sample_s": 20, "rate": 3.0, "warm": 32}
SOAK_TEST = "test_operations.py::test_two_minutes_of_mixed_load_lose_and_leak_nothing"


class BackgroundSoak:
    """The README's service launched, then CI_SOAK run against it, in a thread of the test process while the
    unit tests run (conftest.py starts it when the soak test is selected and orders the unit tests first). The
    soak's fixed two minutes at 3 operations/s leave most of a core idle, and the unit tests use it; nothing the
    soak asserts is timing. `service()` waits for the start, `report()` for the soak; an exception raised in the
    thread is raised there."""

    def __init__(self, tmp_path: Path):
        self.svc = ReadmeService(tmp_path)
        self.svc.launch()
        self.started, self.error, self.result = threading.Event(), None, None
        self.thread = threading.Thread(target=self._run, name="readme-service-soak", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.svc.wait_ready()
            self.started.set()
            self.result = soak(self.svc.url, self.svc.proc.pid, **CI_SOAK)
        except BaseException as e:             # noqa: BLE001 - raised again in the test's thread
            self.error = e
        finally:
            self.started.set()

    def service(self) -> ReadmeService:
        self.started.wait()
        if not self.svc.start_s:
            raise self.error
        return self.svc

    def report(self) -> dict:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result

    def close(self) -> None:
        """Stop the service if it still runs (a session that ended before test_operations.py did). A soak still
        running then only meets refused connections until its two minutes are up; its thread is a daemon and is
        not waited for."""
        if self.svc.proc.poll() is None:
            self.svc.stop()
            self.svc.wait_gone(90)
        self.thread.join(timeout=5)


def check_answers(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    # the demo model ends its greeting after a few tokens; ignore_eos (vLLM's extension) runs to max_tokens
    hello = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 40}
    short = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=hello).json()
    full = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=hello | {"ignore_eos": True}).json()
    assert short["usage"]["completion_tokens"] < 40 and short["choices"][0]["finish_reason"] == "stop"
    assert full["usage"]["completion_tokens"] == 40 and full["choices"][0]["finish_reason"] == "length"
    assert full["choices"][0]["message"]["content"].startswith(short["choices"][0]["message"]["content"])
    r = httpx.post(f"{url}/v1/systemone", timeout=60, json={
        "state": "s", "questions": {"q": {"type": "noul", "question": "is it"}}})
    assert r.status_code == 200 and 0 <= r.json()["answers"]["q"]["noul"] <= 1
    # errors come back through HAProxy as the service wrote them
    bad = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    assert httpx.get(f"{url}/v1/nope", timeout=60).status_code == 404
    # a stream through HAProxy, served by the engine in its own process
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json=hello | {"stream": True}) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert len(events) > 3 and events[-1] == "data: [DONE]"
    chat = httpx.get(f"{url}/debug/stats", timeout=10).json()["chat"]
    # the engine in its own process, in the dtype chat_dtype auto picks on this machine; in fp32 the demo model's
    # linear layers are all under packed.MIN_WEIGHT, where torch's own product is the faster, in bf16 every
    # layer is packed; decode attention in the CPU kernel (a failed build would leave SDPA, slower: not silently),
    # and a decode pass of a few rows as decode_stack.py's one call
    import torch

    from core.chat.weights import chat_dtype
    want = str(chat_dtype("auto", torch.device("cpu"))[0]).removeprefix("torch.")
    linear = "onednn-packed" if want == "bfloat16" else "torch"
    assert (chat["engine"], chat["linear"], chat["attention"], chat["dtype"], chat["decode"]) == \
        ("ProcessEngine", linear, "cpu-kernel", want, "stack"), chat
    # `startlux chat`, as a user runs it against the service (two turns through HAProxy, greedy)
    out = subprocess.run([str(Path(sys.executable).parent / "startlux"), "chat", "--url", url, "--temperature", "0"],
                         input="What is the capital of France?\nAnd of Italy?\n\n", capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.count("> ") == 3 and "Paris" in out.stdout, out


def check_listeners(svc: ReadmeService) -> None:
    """Only loopback, but for the one listener per replica that Ray 2.60 binds on every interface
    (docs/deployment.md, "What listens where")."""
    sockets = listening_sockets(svc.members())
    ours = {port: (name, addr) for _, name, addr, port in sockets}
    assert ours[svc.port] == ("haproxy", "127.0.0.1")
    assert ours[svc.side_ports["RAY_SERVE_HAPROXY_STATS_PORT"]] == ("haproxy", "127.0.0.1")
    assert ours[svc.side_ports["RAY_SERVE_HAPROXY_METRICS_PORT"]] == ("haproxy", "127.0.0.1")
    assert ours[svc.side_ports["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"]][1] == "127.0.0.1"
    # the Ingress's token channel, open since check_answers' streams
    channel = httpx.get(f"{svc.url}/debug/stats", timeout=10).json()["ingress"]["token_channel"]
    host, port = channel["address"].rsplit(":", 1)
    assert channel["messages"] > 0 and host == "127.0.0.1" and ours[int(port)] == ("ray::ServeRepli", "127.0.0.1")
    wide = [(pid, name, addr, port) for pid, name, addr, port in sockets if not loopback(addr)]
    replicas = {pid for pid in svc.members() if comm(pid).startswith("ray::ServeRepli")}
    assert len(replicas) == 3
    # Serve's inter-deployment gRPC server, one per replica ([::]:0 in ray/serve/_private/replica.py)
    assert sorted(pid for pid, *_ in wide) == sorted(replicas), wide
    # and a stale HAProxy of an earlier run is no HAProxy of this one: exactly one serves the ports
    assert [name for _, name, _, port in sockets if port == svc.port] == ["haproxy"]


def check_torch_only_in_children(svc: ReadmeService) -> None:
    """torch is mapped by the two model processes (the chat engine's and the decision scorer's) and by no
    replica: the replicas hand every model call to their child."""
    def maps_torch(pid):
        try:
            return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False
    members = svc.members()
    with_torch = {pid: comm(pid) for pid in members if maps_torch(pid)}
    replicas = [pid for pid in members if comm(pid).startswith("ray::ServeRepli")]
    assert len(replicas) == 3 and not with_torch.keys() & set(replicas), with_torch
    assert len(with_torch) == 2, with_torch


def stop_sigterm_then_sigkill(svc: ReadmeService) -> None:
    """A supervisor with a short stop timeout: SIGTERM to the process group, SIGKILL 3 s later."""
    os.killpg(svc.proc.pid, signal.SIGTERM)
    time.sleep(3)
    try:
        os.killpg(svc.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_sigterm(svc: ReadmeService) -> None:
    """SIGTERM to serve run alone (kill PID)."""
    svc.proc.send_signal(signal.SIGTERM)


def stop_serve_shutdown(svc: ReadmeService) -> None:
    """`serve shutdown` against the running cluster: Serve and HAProxy go, serve run then ends on Ctrl-C."""
    dashboard = re.search(r"View the dashboard at \S*?(http://[0-9.:]+)", svc.log_path.read_text()).group(1)
    # the CLI sends the cluster's token (~/.ray/auth_token, written by serve run) only with RAY_AUTH_MODE=token
    out = subprocess.run([str(Path(sys.executable).parent / "serve"), "shutdown", "-y", "-a", dashboard], cwd=ROOT,
                         env={**os.environ, **svc.env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    wait_until(lambda: not any(comm(p) == "haproxy" for p in svc.members()), 60, "HAProxy outlived serve shutdown",
               0.5)
    svc.stop()


def ignores_sigint(pid: int) -> bool:
    """Whether process `pid` has SIGINT ignored (bit 2 of SigIgn in /proc/<pid>/status)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    mask = int(next(x for x in status if x.startswith("SigIgn:")).split()[1], 16)
    return bool(mask & (1 << (signal.SIGINT - 1)))


def stop_ray(svc: ReadmeService) -> None:
    """The Ray cluster stopped under Serve as `ray stop` stops the raylet and then the GCS: SIGTERM, and SIGKILL
    to what is left 2 s later (`ray stop` waits up to 16 s, but Ray 2.60's raylet and GCS never ended on SIGTERM
    alone with Serve running, so the SIGKILL comes either way). The processes `ray stop` ends between those two
    are left to go on their own (the replicas, their engines, HAProxy): the test is that they do."""
    for name in ("raylet", "gcs_server"):
        pids = [pid for pid in svc.members() if comm(pid) == name]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not any(comm(pid) == name for pid in pids), 2, interval=0.1, fail=False)
        for pid in pids:
            if comm(pid) == name:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
