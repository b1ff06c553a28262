"""cluster/haproxy.py, the launcher Ray runs as HAProxy: listeners rewritten, earlier runs' HAProxies ended."""
import os
import subprocess

from cluster.haproxy import _alive, _cmdline, end, real_binary, rewrite_listeners, stale_haproxies
from cluster.local_cluster import free_port
from tests.waiting import wait_until

CONFIG = """global
    stats timeout 30s
defaults
    mode http
frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind {host}:8000
    log global
backend http-startlux
    server a 127.0.0.1:30000 check
listen stats
  bind *:8404
  stats enable
"""


def binds(text: str) -> dict:
    out, section = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace():
            section = line.strip()
        elif line.strip().startswith("bind "):
            out[section] = line.split()[1]
    return out


def test_listeners_follow_the_frontend_and_stats_stay_on_loopback():
    quick = binds(rewrite_listeners(CONFIG.format(host="127.0.0.1")))
    assert quick == {"frontend prometheus": "127.0.0.1:9101", "frontend http_frontend": "127.0.0.1:8000",
                     "listen stats": "127.0.0.1:8404"}
    node = binds(rewrite_listeners(CONFIG.format(host="*")))
    assert node == {"frontend prometheus": "*:9101", "frontend http_frontend": "*:8000",
                    "listen stats": "127.0.0.1:8404"}
    # everything else is kept as Ray wrote it
    assert rewrite_listeners(CONFIG.format(host="*")).replace("127.0.0.1:8404", "*:8404").replace(
        "*:9101", ":9101") == CONFIG.format(host="*")


def test_an_orphaned_haproxy_of_an_earlier_run_is_found_and_ended(tmp_path):
    binary = real_binary()
    base = tmp_path / "haproxy-serve"
    old, new, other = base / "node-a" / "haproxy.cfg", base / "node-b" / "haproxy.cfg", tmp_path / "x" / "haproxy.cfg"
    for cfg in (old, other):
        cfg.parent.mkdir(parents=True)
        cfg.write_text(f"defaults\n    mode http\n    timeout client 5s\n    timeout server 5s\n    timeout connect 5s\n"
                       f"frontend f\n    bind 127.0.0.1:{free_port()}\n")
    # started from a shell that exits at once: the HAProxy is re-parented, as one whose manager was killed
    out = subprocess.run(["sh", "-c", f"{binary} -db -f {old} >/dev/null 2>&1 & echo $!; "
                                      f"{binary} -db -f {other} >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    orphan, unrelated = map(int, out.stdout.split())
    try:
        wait_until(lambda: all(b"-f" in _cmdline(p) for p in (orphan, unrelated)), 10, "the HAProxies did not start")
        assert stale_haproxies(binary, str(new)) == [orphan]      # beside ours: yes; elsewhere: not ours to end
        end([orphan])
        assert not _alive(orphan) and _alive(unrelated)
    finally:
        for pid in (orphan, unrelated):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
