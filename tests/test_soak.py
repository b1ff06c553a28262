"""Two minutes of bench/soak.py's mixed load (chat streams, completions, decisions, disconnects, bad requests) on
the README's service at a fixed, modest rate: nothing lost, no error but the bad requests' own answers, and
afterwards nothing left running, no process gone or added, no descriptors piling up. Timing is not asserted
(the hour-long run and its slopes are bench/README.md's)."""
import pytest

from bench.soak import run

pytestmark = pytest.mark.serve


def test_two_minutes_of_mixed_load_lose_and_leak_nothing(tmp_path):
    r = run(minutes=2, sample_s=20, load=0.0, calibrate_s=0, rate=3.0, warmup=0.25, work=tmp_path)
    assert sum(r["sent"].values()) > 100 and set(r["sent"]) == {"chat", "completion", "decision", "disconnect", "bad"}
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
