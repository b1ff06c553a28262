"""Operations against the README's service, started once for the module: two minutes of bench/soak.py's mixed
load lose and leak nothing (service and soak start with the session and run beside the unit tests,
conftest.py); Debian's Prometheus scrapes the service with the shipped local config (cluster/prometheus) and
every panel of the Grafana dashboard (cluster/grafana) has series; the metric names docs/deployment.md gives
are the names Prometheus sees; the panels are the ones the docs describe. Last, the service answers and
listens only where it should, and every way of stopping it leaves nothing behind, so that it starts again on
the same ports."""
import asyncio
import collections
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from bench.soak import MIX, soak
from cluster.local_cluster import free_port
from tests.readme_service import (CI_SOAK, ReadmeService, check_answers, check_listeners,
                                  check_torch_only_in_children, ignores_sigint, stop_ray, stop_serve_shutdown,
                                  stop_sigterm, stop_sigterm_then_sigkill)
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "cluster" / "grafana" / "startlux-serve.json"
LOCAL = ROOT / "cluster" / "prometheus" / "local.yml"
PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (apt-get install "
                                                                  "prometheus; CI installs it)")
# A panel whose series appear only with an event this test does not cause: where that event is tested
EVENT_ONLY = {"Streams continued":
              "tests/test_serve.py, test_streams_continue_on_another_replica_when_theirs_is_killed"}
# Counters that exist in Prometheus only once their event happened (Ray exports a counter from its first inc)
EVENT_COUNTERS = {"chat_streams_continued_total": EVENT_ONLY["Streams continued"],
                  "chat_preemptions_total": "tests/test_chat_prefix_cache.py, the preemption tests"}


def panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def runnable(expr: str) -> str:
    """A panel's query as Prometheus takes it: Grafana's variables replaced as Grafana would (all applications)."""
    return expr.replace("$__rate_interval", "1m").replace("$application", ".*")


def docs_section(title: str) -> str:
    text = (ROOT / "docs" / "deployment.md").read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def table_first_column(section: str) -> list[str]:
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [row.split("|")[1].strip() for row in rows[1:]]


def test_the_docs_describe_every_panel_and_every_panel_is_complete():
    doc = [name.strip("*") for name in table_first_column(docs_section("Dashboard"))]
    assert doc == [p["title"] for p in panels()]
    for p in panels():
        assert p["description"] and p["targets"], p["title"]
        assert all(t["expr"] and t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
    ids = [p["id"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert len(ids) == len(set(ids))


def test_the_pod_monitor_scrapes_ports_every_ray_pod_names():
    monitor = yaml.safe_load((ROOT / "cluster" / "prometheus" / "podmonitor.yaml").read_text())
    wanted = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    cluster = yaml.safe_load((ROOT / "cluster" / "rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert wanted <= set(ports), (group.get("groupName", "head"), ports)
        assert ports["metrics"] == int(group["rayStartParams"]["metrics-export-port"])
        assert ports["haproxy-metrics"] == 9101           # RAY_SERVE_HAPROXY_METRICS_PORT's default in Ray 2.60
    assert monitor["spec"]["selector"]["matchLabels"] == {"ray.io/is-ray-node": "yes"}   # KubeRay's pod label


@needs_prometheus
def test_the_local_prometheus_config_is_valid():
    out = subprocess.run([shutil.which("promtool"), "check", "config", str(LOCAL)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


class Prometheus:
    """Debian's Prometheus on a free loopback port, with `config`; stopped by its pid."""

    def __init__(self, config: Path, tmp: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / "prometheus.log", "wb")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        assert r.status_code == 200, (expr, r.text)
        return r.json()["data"]["result"]

    def names(self) -> set[str]:
        return set(httpx.get(f"{self.url}/api/v1/label/__name__/values", timeout=30).json()["data"])

    def targets(self) -> list[dict]:
        return httpx.get(f"{self.url}/api/v1/targets", timeout=30).json()["data"]["activeTargets"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


RAY_DISCOVERY = "/tmp/ray/prom_metrics_service_discovery.json"


def session_dir(svc: ReadmeService) -> Path:
    """The Ray session directory of the service's cluster, from its raylet's command line."""
    for pid in svc.members():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if argv[0].endswith(b"/raylet"):
            return Path(next(a for a in argv if a.startswith(b"--session_dir=")).split(b"=", 1)[1].decode())
    raise AssertionError("the service has no raylet")


@pytest.fixture(scope="module")
def service(background_soak, tmp_path_factory):
    """The README's service, started once for the module's tests (by conftest.py's background soak as the session
    began, when the soak test is selected); the last of them stops it in every way."""
    if background_soak is not None:
        svc = background_soak.service()
    else:
        svc = ReadmeService(tmp_path_factory.mktemp("operations"))
        svc.start()
    try:
        yield svc
    finally:
        if svc.proc is not None and svc.proc.poll() is None:
            svc.stop()
            svc.wait_gone(90)


@pytest.fixture(scope="module")
def live(service, tmp_path_factory):
    """The service, and Debian's Prometheus scraping it with the shipped local config (every second); Prometheus
    stopped by its pid."""
    if PROMETHEUS is None:
        pytest.skip("needs Debian's prometheus (apt-get install prometheus; CI installs it)")
    svc, tmp = service, tmp_path_factory.mktemp("prometheus")
    # the shipped config, on this run's ports and files: Ray's discovery file at /tmp/ray is a link to the
    # newest cluster's (each cluster's dashboard points it at its own), so with another Ray cluster on the
    # machine the test reads this cluster's file in its session directory, as docs/deployment.md says to
    prom_cfg = yaml.safe_load(LOCAL.read_text())
    prom_cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    ray_job = next(j for j in prom_cfg["scrape_configs"] if j["job_name"] == "ray")
    assert ray_job["file_sd_configs"] == [{"files": [RAY_DISCOVERY]}]
    ray_job["file_sd_configs"] = [{"files": [str(session_dir(svc) / Path(RAY_DISCOVERY).name)]}]
    haproxy = next(j for j in prom_cfg["scrape_configs"] if j["job_name"] == "haproxy")
    haproxy["static_configs"] = [{"targets": [f"127.0.0.1:{svc.side_ports['RAY_SERVE_HAPROXY_METRICS_PORT']}"]}]
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(prom_cfg))
    prom = Prometheus(config, tmp)
    try:
        yield svc, prom
    finally:
        prom.stop()


@pytest.mark.serve
def test_two_minutes_of_mixed_load_lose_and_leak_nothing(service, background_soak):
    """bench/soak.py's mix (chat streams, completions, decisions, disconnects, bad requests) for two minutes at a
    fixed, modest rate (CI_SOAK; run beside the unit tests, see conftest.py): nothing lost, no error but the bad
    requests' own answers, and afterwards nothing left running, no process gone or added, no descriptors piling
    up. Timing is not asserted (the hour-long run and its slopes are bench/README.md's)."""
    r = background_soak.report() if background_soak else soak(service.url, service.proc.pid, **CI_SOAK)
    assert r["warm_decisions"]["ok"] == r["warm_decisions"]["sent"] == 32, r["warm_decisions"]
    assert sum(r["sent"].values()) > 100 and set(r["sent"]) == set(MIX), r["sent"]
    assert r["errors"] == {}, r["errors"]
    assert r["ok"] == r["sent"]                 # every operation answered as it should (bad ones with their status)
    idle = r["idle_after"]
    assert idle["chat rows used"] == 0 and idle["chat running"] == 0, idle          # disconnects freed their rows
    assert idle["ingress in flight"] == 0 and idle["ingress waiting"] == 0, idle    # and their admission slots
    assert r["processes_gone"] == [] and r["processes_new"] == [], r
    assert r["process_count"][0] == r["process_count"][1]
    before, after = r["idle_groups"]["before"], r["idle_groups"]["after"]
    grown = {name: (before[name]["fds"], g["fds"]) for name, g in after.items()
             if g["fds"] > before.get(name, {"fds": 0})["fds"] + 16}
    assert not grown, f"descriptors that stayed open after the load: {grown}"


async def burst(url: str, n: int) -> collections.Counter:
    """`n` chat streams at once, more than the Ingress admits and lets wait (48 + 64 in serve_config.cpu.yaml):
    the statuses they got. Each runs 32 tokens past the demo model's end of reply (ignore_eos), so that the
    first ones still run when the last arrive: with 8 tokens that ended on their own, an idle host once
    finished streams as fast as they came and refused none."""
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 32, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=None)) as client:
        async def one():
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                await r.aread()
                return r.status_code
        return collections.Counter(await asyncio.gather(*(one() for _ in range(n))))


@pytest.mark.serve
def test_prometheus_scrapes_the_service_and_every_panel_has_series(live, background_soak):
    """After the soak's traffic and a burst the Ingress refuses in part, every panel's query returns series (but
    the one whose event needs a lost replica), and every metric docs/deployment.md names is one Prometheus has."""
    svc, prom = live
    cfg = yaml.safe_load(svc.config.read_text())["applications"][0]["args"]
    seen = asyncio.run(burst(svc.url, cfg["max_chat_inflight"] + cfg["max_chat_waiting"] + 48))
    assert seen[503] and seen[200], seen
    if background_soak is None:         # the soak test not selected: a little of every kind of traffic instead
        soak(svc.url, svc.proc.pid, minutes=0.25, sample_s=15, rate=3.0)
    # Ray's metrics keep their counts, so the soak's earlier traffic is there to scrape; a rate needs two scrapes
    wanted = {runnable(t["expr"]) for p in panels() if p["title"] not in EVENT_ONLY for t in p["targets"]}
    empty = set(wanted)

    def every_panel_has_series() -> bool:
        empty.difference_update({expr for expr in empty if prom.query(expr)})
        return not empty
    wait_until(every_panel_has_series, 120, interval=1, fail=False)
    targets = prom.targets()
    assert {t["labels"]["job"] for t in targets if t["health"] == "up"} == {"ray", "haproxy"}, targets
    assert not empty, f"panels' queries without series: {sorted(empty)}"
    # the docs' metric names (ray_ prefixed, histograms as _bucket) are what Prometheus has
    names = prom.names()
    documented = re.findall(r"`([a-z_]+)`", "\n".join(
        row.split("|")[1] for row in docs_section("Metrics").splitlines() if row.startswith("| `")))
    assert documented, "no metric names found in docs/deployment.md"
    missing = [n for n in documented if n not in EVENT_COUNTERS
               and f"ray_{n}" not in names and f"ray_{n}_bucket" not in names]
    assert not missing, missing


@pytest.mark.serve
def test_readme_serve_command_answers_and_every_stop_leaves_nothing(service):
    """The service answers and listens on loopback; then each way of stopping it, each followed by a start on the
    same ports. Runs last in the module: it ends the service the other tests share."""
    took = {"first start": service.start_s[0]}
    # as from a terminal, even when the suite itself runs with SIGINT ignored (a background job of a script)
    assert not ignores_sigint(service.proc.pid), "serve run ignores SIGINT: Ctrl-C cannot stop it"
    check_answers(service.url)
    check_listeners(service)
    check_torch_only_in_children(service)
    for name, stop in [("sigterm then sigkill", stop_sigterm_then_sigkill), ("sigterm", stop_sigterm),
                       ("serve shutdown", stop_serve_shutdown), ("ray stopped", stop_ray),
                       ("ctrl-c", ReadmeService.stop)]:
        t0 = time.monotonic()
        stop(service)
        # a stop takes seconds (the took dict printed below); two minutes is a stop that does not end, and
        # wait_gone then has serve run print its threads' stacks into the message
        left = service.wait_gone(120.0)
        took[name] = time.monotonic() - t0
        assert not left, f"left running after {name}: {left}; serve run's log ends:\n{service.stuck}"
        if name != "ctrl-c":
            took[f"start after {name}"] = service.start()
            assert httpx.get(f"{service.url}/v1/models", timeout=30).status_code == 200
    print({k: round(v, 1) for k, v in took.items()})


def test_kept_gauges_are_set_again_until_set_otherwise():
    """Ray's agent forgets a gauge value not set again within its TTL: deployments/gauges.py sets every kept value
    again each period, per tag set, with the latest value."""
    from deployments import gauges

    class Recording:
        def __init__(self):
            self.sets = []

        def set(self, value, tags=None):
            self.sets.append((value, tags))

    g = Recording()
    gauges.kept(g).set(3.0, tags={"model": "a"})
    gauges.kept(g).set(4.0, tags={"model": "a"})
    gauges.kept(g).set(1.0, tags={"model": "b"})
    g.sets.clear()
    gauges.refresh()
    assert sorted(g.sets, key=lambda s: s[1]["model"]) == [(4.0, {"model": "a"}), (1.0, {"model": "b"})]
