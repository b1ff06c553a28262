"""The production manifests stay in step with serve_config.yaml."""
from pathlib import Path

import yaml

from cluster.cli import HAPROXY, LAUNCHER, THROUGHPUT

ROOT = Path(__file__).resolve().parent.parent


def test_rayservice_serves_serve_config():
    rs = yaml.safe_load((ROOT / "cluster" / "rayservice.yaml").read_text())
    assert rs["kind"] == "RayService"
    assert yaml.safe_load(rs["spec"]["serveConfigV2"]) == yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (gpu,) = cluster["workerGroupSpecs"]
    assert gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    deps = {d["name"]: d for d in serve["applications"][0]["deployments"]}
    most_gpus = sum(deps[n]["autoscaling_config"]["max_replicas"] for n in ("ChatModel", "DecisionModel"))
    assert gpu["maxReplicas"] >= most_gpus, "the node group must be able to hold every model replica"
    # the CPUs too: every replica at its maximum (the head takes none), each model replica's CPUs on a node with its GPU
    cpus = lambda d: d["ray_actor_options"].get("num_cpus", 1) * d["autoscaling_config"]["max_replicas"]
    node_cpus = int(limits["cpu"])
    assert sum(cpus(d) for d in deps.values()) <= node_cpus * gpu["maxReplicas"]
    assert all(d["ray_actor_options"]["num_cpus"] <= node_cpus for d in deps.values())
    # a chat replica relays its streams on one core beside its engine process's (docs/deployment.md, CPU budget)
    assert deps["ChatModel"]["ray_actor_options"]["num_cpus"] >= 2
    for container in (gpu["template"]["spec"]["containers"][0],
                      cluster["headGroupSpec"]["template"]["spec"]["containers"][0]):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} <= set(env)
        assert THROUGHPUT.items() <= env.items()   # every node: controller, proxy and replicas agree
        assert HAPROXY.items() <= env.items()      # HAProxy answers on port 8000 of every node
        assert env["RAY_SERVE_HAPROXY_BINARY_PATH"].endswith(f"/bin/{LAUNCHER}")   # through the launcher


def test_cluster_launcher_config():
    cfg = yaml.safe_load((ROOT / "cluster" / "cluster.yaml").read_text())
    types = cfg["available_node_types"]
    assert types[cfg["head_node_type"]]["resources"] == {"CPU": 0}
    assert types["gpu_worker"]["max_workers"] >= types["gpu_worker"]["min_workers"]
    assert any("-c constraints.txt" in c and "[gpu]" in c for c in cfg["worker_setup_commands"])
    assert any("serve deploy serve_config.yaml" in c for c in cfg["head_start_ray_commands"])
    for cmd in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]:
        for key, value in (THROUGHPUT | HAPROXY).items():
            assert f"{key}={value}" in cmd
        assert f"RAY_SERVE_HAPROXY_BINARY_PATH=$HOME/startlux/.venv/bin/{LAUNCHER}" in cmd


def test_the_image_sets_the_services_ray_settings():
    docker = (ROOT / "cluster" / "Dockerfile").read_text()
    for key, value in (THROUGHPUT | HAPROXY).items():
        assert f"{key}={value}" in docker
    assert f"RAY_SERVE_HAPROXY_BINARY_PATH=/home/ray/anaconda3/bin/{LAUNCHER}" in docker


def test_free_ports_come_from_outside_the_ephemeral_range_and_skip_ports_in_use(monkeypatch):
    """The ports the tests and benchmarks fix ahead of a start lie where no socket that asks the kernel for a port
    (Ray's processes) and no Ray worker can land, and one already bound is passed over."""
    import socket

    from cluster import local_cluster

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [local_cluster.free_port() for _ in range(50)]
    assert all(20000 <= p < low for p in ports), ports
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[0]))
        other = next(p for p in ports if p != ports[0])
        picks = iter([ports[0], other])
        monkeypatch.setattr(local_cluster._PORTS, "randrange", lambda a, b: next(picks))
        assert local_cluster.free_port() == other


def test_a_server_started_with_default_sigint_stops_on_ctrl_c_even_below_a_background_job():
    """A background job of a non-interactive shell starts with SIGINT ignored; a Python process below it keeps it
    ignored (no KeyboardInterrupt), unless started with default_sigint."""
    import signal
    import subprocess
    import sys

    from cluster.local_cluster import default_sigint

    probe = [sys.executable, "-c",
             "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"]
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)       # as under `cmd &` in a script
    try:
        inherited = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
        reset = subprocess.run(probe, capture_output=True, text=True, check=True,
                               preexec_fn=default_sigint).stdout.strip()
    finally:
        signal.signal(signal.SIGINT, before)
    assert (inherited, reset) == ("False", "True")
