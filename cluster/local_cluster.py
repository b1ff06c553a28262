"""A multi-node Ray cluster on one machine, for development and CI.

    python -m cluster.local_cluster up [--workers 2] [--config cluster/serve_config.local.yaml]
    python -m cluster.local_cluster status
    python -m cluster.local_cluster down

`up` starts a head node (no model resources: controller, proxy, and the ingress, pinned there by a
`head_node` resource) and worker nodes that each offer one `model_node` resource, so model replicas land on workers and can be pinned to them; then it
deploys the config with `serve deploy`, as production does. Each node is one `ray start --block`
process in its own session: stopping a node means stopping that process group by its own id, which
takes down exactly the processes that node started and nothing else on the machine. The ids live in a
state file (`.local_cluster.json`), which `down` reads.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from .cli import THROUGHPUT

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STATE = ROOT / ".local_cluster.json"


_PORTS = random.Random()      # its own generator: tests that seed the global one must not make ports repeat


def free_port() -> int:
    """A free loopback port between Ray's worker ports (10002-19999 by default) and the kernel's ephemeral range
    (from 32768 here). A port chosen now is often bound much later (a service's side ports, kept for all its
    restarts); one from the ephemeral range could be taken meanwhile by any socket that asks the kernel for a
    port, and the dozens of Ray processes a start launches do (HAProxy once failed to bind its stats port so)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for _ in range(1000):
        port = _PORTS.randrange(20000, max(ephemeral, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and the ephemeral range")


def default_sigint() -> None:
    """Popen's preexec_fn for a process that must stop on Ctrl-C (SIGINT), as from a terminal: the default
    disposition, whatever the parent inherited. A background job of a non-interactive shell (`cmd &`, nohup)
    starts with SIGINT ignored, every process below it inherits that, and Python then keeps SIGINT ignored
    instead of raising KeyboardInterrupt: `serve run` started so sleeps through every Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Node:
    name: str
    pid: int                       # the `ray start --block` process; its process group is the node
    log: str


_PROCS: dict[int, subprocess.Popen] = {}     # nodes started by this process, so that they can be reaped


@dataclass
class LocalCluster:
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="ray-local-"))
    # Ray 2.60 authenticates every node and client with a shared token; this cluster gets its own
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    nodes: list[Node] = field(default_factory=list)
    join_s: list[float] = field(default_factory=list)   # how long each worker took to join, in order

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def _start(self, name: str, args: list[str]) -> Node:
        log = os.path.join(self.temp_dir, f"{name}.log")
        ports = ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
                 "--metrics-export-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
                 "--dashboard-agent-grpc-port", str(free_port()), "--runtime-env-agent-port", str(free_port())]
        with open(log, "wb") as f:
            proc = subprocess.Popen([str(BIN / "ray"), "start", "--block", "--node-ip-address", "127.0.0.1",
                                     *ports, *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                    start_new_session=True, env=self._env())
        _PROCS[proc.pid] = proc
        node = Node(name, proc.pid, log)
        self.nodes.append(node)
        return node

    def _env(self) -> dict:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        for key, value in THROUGHPUT.items():   # the request path production runs (docs/configuration.md)
            env.setdefault(key, value)
        # HAProxy stays off here: every "node" of this cluster shares one host, and each node's HAProxy would
        # bind the same ports (8000, 8404, 9101); Serve's proxy on the head answers instead.
        # notice a lost node within seconds (Ray's defaults are tuned for flaky cloud networks)
        env.setdefault("RAY_health_check_period_ms", "1000")
        env.setdefault("RAY_health_check_failure_threshold", "3")
        return env

    def start_head(self, num_cpus: int = 4) -> Node:
        node = self._start("head", ["--head", "--port", str(self.gcs_port), "--num-cpus", str(num_cpus),
                                    "--resources", json.dumps({"head_node": 1}),
                                    "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                                    "--dashboard-port", str(self.dashboard_port), "--temp-dir", self.temp_dir])
        self.wait_for_nodes(1)
        return node

    def add_worker(self, num_cpus: int = 2, attempts: int = 3, timeout: float = 120) -> Node:
        """A worker node, once it has joined. `ray start` gives up after about 30 s when the GCS is too busy to
        answer (a loaded 2-core host): a node that exits before joining is started again, as an autoscaler
        launches another, up to `attempts` times. One at a time: two workers started together on one host share
        the cluster's temporary directory, and one of them can time out waiting for its raylet."""
        before, t0 = self._node_ids(), time.monotonic()
        for attempt in range(1, attempts + 1):
            name = f"worker{sum(n.name.startswith('worker') for n in self.nodes) + 1}"
            node = self._start(name, ["--address", self.address, "--num-cpus", str(num_cpus),
                                      "--resources", json.dumps({"model_node": 1})])
            proc, deadline = _PROCS[node.pid], time.monotonic() + timeout
            while time.monotonic() < deadline and proc.poll() is None:
                if self._node_ids() - before:
                    self.join_s.append(time.monotonic() - t0)
                    return node
                time.sleep(1)
            if proc.poll() is None:
                raise TimeoutError(f"{name} did not join within {timeout:.0f} s; its log: {node.log}")
            self.kill(node)                             # whatever of that node did start
            print(f"{name} exited before joining (attempt {attempt} of {attempts}; its log: {node.log})",
                  file=sys.stderr, flush=True)
        raise RuntimeError(f"no worker joined in {attempts} attempts; logs in {self.temp_dir}")

    def _node_ids(self) -> set[str]:
        try:
            return {n["raylet"]["nodeId"] for n in self.ray_nodes()}
        except (httpx.HTTPError, KeyError, ValueError):     # the dashboard is not up yet, or busy
            return set()

    def alive_nodes(self) -> list[Node]:
        out = []
        for n in self.nodes:
            proc = _PROCS.get(n.pid)
            if proc is not None and proc.poll() is not None:   # reaped: a zombie would still look alive
                continue
            try:
                os.killpg(n.pid, 0)
                out.append(n)
            except ProcessLookupError:
                pass
        return out

    def ray_nodes(self) -> list[dict]:
        r = httpx.get(f"http://127.0.0.1:{self.dashboard_port}/nodes?view=summary", timeout=10,
                      headers={"Authorization": f"Bearer {self.token}"})
        return [n for n in r.json()["data"]["summary"] if n["raylet"]["state"] == "ALIVE"]

    def replica_nodes(self, deployment: str, app: str = "startlux") -> list[str]:
        """Node ids of the ALIVE replicas of a deployment."""
        r = httpx.get(f"http://127.0.0.1:{self.dashboard_port}/api/v0/actors", timeout=10,
                      params={"limit": 10000, "detail": "true"}, headers={"Authorization": f"Bearer {self.token}"})
        actors = r.json()["data"]["result"]["result"]
        return [a["node_id"] for a in actors
                if a.get("class_name") == f"ServeReplica:{app}:{deployment}" and a.get("state") == "ALIVE"]

    def deployments(self, app: str = "startlux") -> dict:
        """Serve's own view of an application's deployments (status, target_num_replicas, replicas with their
        state), from the dashboard's /api/serve/applications/, the source of `serve status`."""
        r = httpx.get(f"http://127.0.0.1:{self.dashboard_port}/api/serve/applications/", timeout=10,
                      headers={"Authorization": f"Bearer {self.token}"})
        return r.json()["applications"][app]["deployments"]

    def wait_for_nodes(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if len(self.ray_nodes()) >= count:
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(1)
        raise TimeoutError(f"the cluster did not reach {count} nodes; logs in {self.temp_dir}")

    def deploy(self, config: str) -> None:
        subprocess.run([str(BIN / "serve"), "deploy", config, "--address", f"http://127.0.0.1:{self.dashboard_port}"],
                       check=True, cwd=ROOT, env=self._env(), capture_output=True, timeout=120)

    def serve_status(self) -> dict:
        out = subprocess.run([str(BIN / "serve"), "status", "--address", f"http://127.0.0.1:{self.dashboard_port}"],
                             check=True, cwd=ROOT, env=self._env(), capture_output=True, timeout=60, text=True)
        import yaml

        return yaml.safe_load(out.stdout)

    def kill(self, node: Node, sig: int = signal.SIGKILL) -> None:
        """Stop one node: its process group, by the id of the process that started it."""
        try:
            os.killpg(node.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL and node.pid in _PROCS:
            _PROCS[node.pid].wait(timeout=30)

    def stop(self, grace_s: float = 16.0) -> None:
        """The workers, then the head, as `ray stop` ends a node: SIGTERM (`ray start --block` stops its node's
        processes), SIGKILL to what is left after `grace_s`. Workers first, while the GCS they report to is
        still there: stopped together, every node waited half a minute for it; one after another, a worker
        goes in about a second, and the head takes over half a minute on SIGTERM alone (its GCS and dashboard
        linger), so the grace period is what ends it."""
        head = [n for n in self.nodes if n.name == "head"]
        for group in ([n for n in self.nodes if n not in head], head):
            for node in group:
                self.kill(node, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while (alive := [n for n in self.alive_nodes() if n in group]) and time.monotonic() < deadline:
                time.sleep(0.2)
            for node in alive:
                self.kill(node, signal.SIGKILL)
        self.nodes = []

    def save(self, path: Path = STATE) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))
        path.chmod(0o600)     # it holds the cluster's token

    @classmethod
    def load(cls, path: Path = STATE) -> "LocalCluster":
        data = json.loads(path.read_text())
        data["nodes"] = [Node(**n) for n in data["nodes"]]
        return cls(**data)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m cluster.local_cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("up", "status", "down"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--config", default=str(ROOT / "cluster" / "serve_config.local.yaml"))
    args = p.parse_args()
    if args.action == "up":
        if STATE.exists():
            sys.exit(f"{STATE} exists: a cluster from this checkout may be running; run `down` first")
        cluster = LocalCluster()
        cluster.save()
        cluster.start_head()
        cluster.save()
        for _ in range(args.workers):
            cluster.add_worker()
            cluster.save()
        cluster.deploy(args.config)
        print(f"ray: {cluster.address}  dashboard: http://127.0.0.1:{cluster.dashboard_port}  "
              f"nodes: {[n.name for n in cluster.nodes]}  logs: {cluster.temp_dir}")
    elif args.action == "status":
        cluster = LocalCluster.load()
        print(json.dumps(cluster.serve_status(), indent=2, default=str))
    else:
        cluster = LocalCluster.load()
        names = [n.name for n in cluster.nodes]
        cluster.stop()
        STATE.unlink()
        print("stopped", ", ".join(names))


if __name__ == "__main__":
    main()
