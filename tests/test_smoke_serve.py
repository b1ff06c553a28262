"""The README's serve command as a subprocess: it starts, answers, and shuts down cleanly."""
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.test_serve import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.serve


def readme_serve_command() -> tuple[dict, list[str]]:
    """The environment assignments and arguments of `serve run` in the README's first command."""
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if "serve run serve_config.cpu.yaml" in x
                and x.startswith("python3 -m venv"))
    words = shlex.split(line.split("&&")[-1])
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


def test_readme_serve_command(tmp_path):
    env, argv = readme_serve_command()
    assert argv == [".venv/bin/serve", "run", "serve_config.cpu.yaml"], argv
    assert env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"   # HAProxy answers on the port, in front of the Ingress
    # HAProxy's own listeners (metrics, stats) and Serve's fallback proxy on free ports, not their fixed defaults
    env |= {"RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port())}
    cfg = yaml.safe_load((ROOT / "serve_config.cpu.yaml").read_text())
    port = free_port()
    cfg["http_options"]["port"] = port
    config = tmp_path / "serve_config.cpu.yaml"
    config.write_text(yaml.safe_dump(cfg))
    serve_bin = Path(sys.executable).parent / "serve"
    log = open(tmp_path / "serve.log", "wb")
    # its own session: the process group id is the pid, so everything it starts is stopped by that id
    proc = subprocess.Popen([str(serve_bin), "run", str(config)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **env}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        ready = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"{url}/healthz", timeout=5).status_code == 200
            except httpx.HTTPError:
                ready = False
            if ready:
                break
            time.sleep(1)
        assert ready, (tmp_path / "serve.log").read_text()[-3000:]
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
        assert httpx.get(f"{url}/debug/stats", timeout=10).json()["chat"]["engine"] == "ProcessEngine"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)        # serve run's own clean shutdown: Serve, then its Ray
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 15           # its Ray processes (and HAProxy) finish exiting
        while session_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = session_members(proc.pid)
        for pid in left:                           # what it started and left behind, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)
        log.close()
    assert proc.returncode is not None
    assert not left, f"processes left running after serve run exited: {left}"
