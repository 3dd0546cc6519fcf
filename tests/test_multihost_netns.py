"""A real multi-host cluster: scripts/multihost_netns.py puts the dispatcher, two prefill
workers, one decode worker and a client each in a network namespace of its own on a
private subnet (veth links to a bridge), secured as for separate hosts (API key to the
workers, CURVE on KV), replays a short priority-tagged workload through the dispatcher,
checks it and tears it all down. This test runs the script and asserts its checks.

It runs the script's --membership mode (issue 15): a second decode worker in a namespace
of its own joins through the dispatcher's admin API while the workload runs, the busiest
prefill worker is drained mid-run and removed once its requests have ended, and d0 is
drained and resumed; nothing is lost, a drained worker takes no request while drained
and the added decode worker serves some. And --dispatchers 2 (issue 15): a second
dispatcher in its own namespace in front of the same workers, the replay split over both,
the prefill workers publishing their queues (CURVE) to both; each dispatcher must have seen
the other's requests in those publications.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2, no
`ip netns add`): the script's --probe tries it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "multihost_netns.py"


def _probe() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (the multi-host test makes eight of them)"
    p = subprocess.run([sys.executable, str(SCRIPT), "--probe"], check=False, capture_output=True, text=True,
                       timeout=60)
    if p.returncode == 3:
        return p.stderr.strip() or "the script's --probe says namespaces cannot be made here"
    assert p.returncode == 0, p.stdout + p.stderr
    return None


def _namespaces() -> set[str]:
    p = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=30)
    return {line.split()[0] for line in p.stdout.splitlines() if line.strip()}


def test_multihost_cluster_in_network_namespaces(tmp_path):
    why = _probe()
    if why:
        pytest.skip(f"multi-host test: {why}")
    before = _namespaces()
    out, js = tmp_path / "run", tmp_path / "summary.json"
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(out), "--json", str(js), "--requests", "30",
                          "--membership", "--dispatchers", "2"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)          # the script tears down what it made on SIGTERM
        try:
            stdout, stderr = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
    took = time.monotonic() - t0
    print(stdout[-6000:])
    summary = json.loads(js.read_text()) if js.exists() else {}
    logs = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-2500:]}" for f in sorted(out.glob("*.log")))
    # what failed first: the script's report puts its long listener table after the checks
    failed = {x: {k: v for k, v in y.items() if k != "per_namespace"}
              for x, y in summary.get("checks", {}).items() if isinstance(y, dict) and not y.get("ok")}
    why = json.dumps({"error": summary.get("error"), "failed checks": failed}, default=str)[:6000]
    assert p.returncode == 0 and summary.get("ok"), (f"rc {p.returncode} after {took:.0f} s\n{why}\n"
                                                     f"{stdout[-6000:]}\n{stderr[-3000:]}\n{logs}")
    c = summary["checks"]
    assert set(c) == {"requests", "kv_bytes", "kv_tcp", "listeners", "auth", "kv_curve", "membership",
                      "dispatchers"}
    assert all(v["ok"] for v in c.values())
    # every request answered with what it asked for, both classes served
    r = c["requests"]
    assert r["answered"] == r["sent"] == 30 and not r["bad"] and set(r["by_class"]) == {"high", "low"}
    assert r["dispatcher_records"] == 30 and not r["dispatcher_not_ok"]
    # KV: what the prefill hosts sent is what the decode host received, over TCP from their addresses
    k = c["kv_bytes"]
    assert k["sent_total"] == k["received_by_decode"] > 0 and k["received_transfers"] == 30
    assert c["kv_tcp"]["wire_total"] >= k["received_by_decode"]
    hosts = summary["hosts"]
    assert set(c["kv_tcp"]["bytes_received_from"]) <= {hosts["p0"], hosts["p1"]}
    # membership: d1 added mid-run served requests (its KV came over TCP too), p1 drained then removed
    m = c["membership"]
    assert m["steps"] and all(s["ok"] for s in m["steps"])
    assert m["state_after_drain"] == ["draining"] and m["drained"] not in m["listed_after_delete"]
    brief = {x: v for x, v in m.items() if x != "steps"}
    assert m["requests_after_drain"] > 0 and m["routed_to_drained_after_drain"] == [], brief
    assert m["requests_while_d0_drained"] > 0 and m["decode_on_d0_while_drained"] == [], brief
    assert m["decode_on_added"] > 0 and k["received_by_decode_worker"]["d1"] > 0, brief
    # two dispatchers: each served its share and saw the other's requests in the queue publications
    per = c["dispatchers"]["per_dispatcher"]
    assert len(per) == 2
    for d in per.values():
        assert d["records"] > 0 and d["publications_ok"] > 0 and d["publications_malformed"] == 0
        assert d["foreign_requests_seen"] > 0
    # nothing on a wildcard address; beyond loopback only the intended ports
    ls = c["listeners"]
    assert not ls["wildcard"] and not ls["unexpected_non_loopback"] and not ls["intended_missing"]
    # the workers want their API key
    for role in ("p0", "p1", "d0"):
        codes = c["auth"]["status_codes"][role]
        assert codes["GET /v1/models without key"] == 401 and codes["GET /v1/models with the key"] == 200
    # torn down: no namespace of this run left
    assert summary["info"]["namespaces_after"] == []
    assert not {n for n in _namespaces() - before if n.startswith(summary["tag"])}
