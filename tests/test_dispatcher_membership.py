"""Dynamic membership (issue 15): the admin API adds, drains and removes workers while
requests flow, and DNS discovery follows a name's addresses (an injected resolver).
Nothing here depends on wall-clock speed: requests are kept in flight by the fake
workers' ``hold`` events, and every wait is a bounded wait for a condition."""

from __future__ import annotations

import asyncio

import pytest
from dispatcher_helpers import KEYS, harness, metric, run, until
from pd_helpers import free_port

from proserve.bench.fake_worker import FakeWorker
from proserve.dispatcher import membership
from proserve.dispatcher.config import DiscoverSpec, DispatcherConfig, PrefillSpec, config_from_dict, keys_from_dict
from proserve.dispatcher.server import Dispatcher
from proserve.scheduler.registry import router_order
from proserve.scheduler.request import ConfigError

ADMIN = "admin-key-0123456789abcdef"
BODY = {"prompt": "hello there world", "max_tokens": 4}


@pytest.fixture
def admin_file(tmp_path):
    p = tmp_path / "admin.key"
    p.write_text(ADMIN + "\n")
    return str(p)


async def admin(h, method: str, path: str, body=None, key: str | None = ADMIN):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return await h.http.request(method, "/admin/workers" + path, json=body, headers=headers)


async def listed(h) -> dict[str, dict]:
    r = await admin(h, "GET", "")
    assert r.status_code == 200, r.text
    return {w["name"]: w for w in r.json()["data"]}


class Traffic:
    """A steady stream of requests (one started every ``pace_s``, each awaited on its own
    task), every status kept: the membership changes must lose none."""

    def __init__(self, h, pace_s: float = 0.01, stream_every: int = 3):
        self.h, self.pace_s, self.stream_every = h, pace_s, stream_every
        self.statuses: list[int] = []
        self.tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()
        self._producer: asyncio.Task | None = None

    async def _one(self, i: int) -> None:
        body = {**BODY, "prompt": f"request {i} hello"}
        if i % self.stream_every == 0:
            status, events = await self.h.stream("/v1/completions", body)
            assert status != 200 or events[-1] == "[DONE]", events[-2:]
            assert status != 200 or all("error" not in e for e in events if isinstance(e, dict)), events
        else:
            status = (await self.h.post("/v1/completions", body)).status_code
        self.statuses.append(status)

    async def _produce(self) -> None:
        i = 0
        while not self._stop.is_set():
            self.tasks.append(asyncio.create_task(self._one(i)))
            i += 1
            await asyncio.sleep(self.pace_s)

    def start(self) -> Traffic:
        self._producer = asyncio.create_task(self._produce())
        return self

    async def more(self, n: int) -> None:
        """Until ``n`` more requests have ended."""
        goal = len(self.statuses) + n
        await until(lambda: len(self.statuses) >= goal, 20, f"{n} more requests")

    async def stop(self) -> list[int]:
        self._stop.set()
        await self._producer
        await asyncio.wait_for(asyncio.gather(*self.tasks), 30)
        return self.statuses


# -- the admin API: access ----------------------------------------------------------------------------
def test_admin_api_needs_the_admin_key(admin_file):
    async def go():
        async with harness(admin_key_file=admin_file) as h:
            for key in (None, "sk-high-000001", "sk-low-0000001", "wrong-admin-key-000000", ADMIN + "x"):
                r = await admin(h, "GET", "", key=key)
                assert r.status_code == 401, (key, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
            r = await admin(h, "POST", "", {"role": "decode", "url": "http://127.0.0.1:1",
                                            "kv_addr": "tcp://127.0.0.1:2"}, key="sk-high-000001")
            assert r.status_code == 401
            assert len(h.d.registry.decode) == 1
            r = await admin(h, "POST", "/p0/drain", key=None)
            assert r.status_code == 401 and not h.d.registry.prefill[0].draining
            r = await admin(h, "DELETE", "/p0", key="sk-high-000001")
            assert r.status_code == 401 and len(h.d.registry.prefill) == 1
            ws = await listed(h)
            assert set(ws) == {"p0", "d0"}
            assert ws["p0"]["state"] == "healthy" and ws["p0"]["requests"] == 0 and ws["p0"]["source"] == "config"
            assert ws["d0"]["kv_addr"] == "tcp://127.0.0.1:16000"
            assert metric(await h.metrics(), "proserve:dispatcher_rejected_total", reason="admin_auth") == 8
    run(go())


def test_admin_api_is_off_without_an_admin_key():
    async def go():
        async with harness() as h:
            for key in (None, "sk-high-000001", ADMIN):
                r = await admin(h, "GET", "", key=key)
                assert r.status_code == 403, r.text
                assert r.json()["error"]["code"] == "admin_api_off"
            r = await admin(h, "DELETE", "/p0")
            assert r.status_code == 403 and len(h.d.registry.prefill) == 1
    run(go())


def test_admin_key_checks(tmp_path):
    cfg = DispatcherConfig(prefill=[PrefillSpec("http://127.0.0.1:8100")], deployment="colocated")
    short = tmp_path / "short.key"
    short.write_text("too-short")
    cfg.admin_key_file = str(short)
    with pytest.raises(ConfigError, match="at least 16"):
        Dispatcher(cfg)
    cfg.admin_key_file = str(tmp_path / "missing.key")
    with pytest.raises(ConfigError, match="cannot read"):
        Dispatcher(cfg)
    same = tmp_path / "client.key"
    same.write_text("sk-client-key-that-is-long")
    cfg.admin_key_file = str(same)
    keys = keys_from_dict({"keys": [{**KEYS["keys"][1], "key": "sk-client-key-that-is-long"}]}, cfg.classes)
    with pytest.raises(ConfigError, match="client API key"):
        Dispatcher(cfg, keys)


# -- the admin API: validation ------------------------------------------------------------------------
def test_admin_api_validates_every_body(admin_file):
    async def go():
        async with harness(admin_key_file=admin_file) as h:
            d0 = h.decodes[0].url
            cases = [
                ([1, 2], 400, None),
                ({"role": "router", "url": "http://127.0.0.1:1"}, 400, "role"),
                ({"url": "http://127.0.0.1:1"}, 400, "role"),
                ({"role": "prefill"}, 400, "url"),
                ({"role": "prefill", "url": "ftp://127.0.0.1:1"}, 400, "url"),
                ({"role": "prefill", "url": "http://127.0.0.1:1/v1"}, 400, "url"),
                ({"role": "prefill", "url": "http://127.0.0.1:99999"}, 400, "url"),
                ({"role": "prefill", "url": "http://u:p@127.0.0.1:1"}, 400, "url"),
                ({"role": "prefill", "url": "http://127.0.0.1:1?x=1"}, 400, "url"),
                ({"role": "prefill", "url": 7}, 400, "url"),
                ({"role": "prefill", "url": "http://127.0.0.1:1", "kv_addr": "tcp://127.0.0.1:2"}, 400, "kv_addr"),
                ({"role": "prefill", "url": "http://127.0.0.1:1", "local_policy": "nope"}, 400, "local_policy"),
                ({"role": "decode", "url": "http://127.0.0.1:1"}, 400, "kv_addr"),
                ({"role": "decode", "url": "http://127.0.0.1:1", "kv_addr": "udp://x"}, 400, "kv_addr"),
                ({"role": "decode", "url": "http://127.0.0.1:1", "kv_addr": "tcp://127.0.0.1:2",
                  "local_policy": "vllm_fcfs"}, 400, "local_policy"),
                ({"role": "prefill", "url": "http://127.0.0.1:1", "name": "a/b"}, 400, "name"),
                ({"role": "prefill", "url": "http://127.0.0.1:1", "name": ""}, 400, "name"),
                ({"role": "prefill", "url": "http://127.0.0.1:1", "name": "x" * 200}, 400, "name"),
                ({"role": "prefill", "url": "http://127.0.0.1:1", "latency_model": "/etc/passwd"}, 400,
                 "latency_model"),
                ({"role": "prefill", "url": h.prefills[0].url}, 409, "url"),
                ({"role": "decode", "url": d0 + "/", "kv_addr": "tcp://127.0.0.1:3"}, 409, "url"),
                ({"role": "prefill", "url": "http://127.0.0.1:1", "name": "d0"}, 409, "name"),
                ({"role": "decode", "url": "http://127.0.0.1:1", "kv_addr": "tcp://127.0.0.1:16000"}, 409, "kv_addr"),
            ]
            for body, status, param in cases:
                r = await admin(h, "POST", "", body)
                assert r.status_code == status, (body, r.text)
                err = r.json()["error"]
                assert err["message"] and err["param"] == param, (body, err)
            r = await h.http.post("/admin/workers", content=b"{not json", headers={
                "authorization": f"Bearer {ADMIN}", "content-type": "application/json"})
            assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
            for method, path, status in (("POST", "/nope/drain", 404), ("POST", "/nope/resume", 404),
                                         ("DELETE", "/nope", 404), ("DELETE", "/p0?force=maybe", 400),
                                         ("PUT", "/p0", 405)):
                r = await admin(h, method, path)
                assert r.status_code == status, (method, path, r.text)
                assert "error" in r.json()
            assert set(await listed(h)) == {"p0", "d0"}      # nothing was added
            assert (await h.post("/v1/completions", BODY)).status_code == 200
    run(go())


def test_worker_hosts_limit_where_added_workers_may_be(admin_file):
    """With worker_hosts, every address of a worker added at run time (its URL, kv_addr,
    kv_events, publish) must be on an allowed host, as written: the worker key and the
    prompts go there. Refused: 403 naming the field, nothing added. ipc:// stays local."""
    async def go():
        # (without the side channels' keys check in the way: the allow-list must refuse on its own)
        async with harness(admin_key_file=admin_file, worker_hosts=["127.0.0.0/30", "*.Allowed.test"],
                           kv_events_insecure=True, publication_insecure=True) as h:
            assert h.d.cfg.worker_hosts == ["127.0.0.0/30", "*.allowed.test"]
            refused = [
                ({"role": "prefill", "url": "http://127.0.0.9:1"}, "url"),
                ({"role": "prefill", "url": "http://evil.test:1"}, "url"),
                ({"role": "prefill", "url": "http://allowed.test:1"}, "url"),       # the suffix, not a name under it
                ({"role": "prefill", "url": "http://x.allowed.test.evil:1"}, "url"),
                ({"role": "prefill", "url": "http://[::1]:1"}, "url"),              # loopback, but not listed
                ({"role": "decode", "url": "http://127.0.0.2:1", "kv_addr": "tcp://10.0.0.1:2"}, "kv_addr"),
                ({"role": "decode", "url": "http://127.0.0.2:1", "kv_addr": "tcp://evil.test"}, "kv_addr"),
                ({"role": "prefill", "url": "http://127.0.0.2:1", "kv_events": "tcp://127.0.0.9:5"}, "kv_events"),
                ({"role": "prefill", "url": "http://127.0.0.2:1", "publish": "tcp://127.0.0.9:6"}, "publish"),
                # read strictly, or not at all (found by an adversarial pass): libzmq cuts a "zone" at
                # '%' even from a name and connects to what is before it; its source;destination form
                # connects to the destination; a scoped IPv6 address; an IPv4 address written as a
                # name (the resolver reads 0x7f000002 and 127.2 as 127.0.0.2)
                ({"role": "prefill", "url": "http://127.0.0.2:1", "kv_events": "tcp://127.0.0.9%1.allowed.test:5"},
                 "kv_events"),
                ({"role": "prefill", "url": "http://127.0.0.2:1", "publish": "tcp://127.0.0.1:0;127.0.0.9:6"},
                 "publish"),
                ({"role": "decode", "url": "http://127.0.0.2:1", "kv_addr": "tcp://[::1%1]:2"}, "kv_addr"),
                ({"role": "prefill", "url": "http://0x7f000002:1"}, "url"),
                ({"role": "prefill", "url": "http://127.2:1"}, "url"),
                ({"role": "prefill", "url": "http://[fe80::1%25lo]:1"}, "url"),
            ]
            for body, param in refused:
                r = await admin(h, "POST", "", body)
                assert r.status_code == 403, (body, r.text)
                err = r.json()["error"]
                assert err["param"] == param and err["type"] == "permission_error", (body, err)
                # the list itself is not told (it would map what a leaked admin key may reach)
                assert "worker_hosts" in err["message"] and "127.0.0.0/30" not in err["message"], err
            # not printable ASCII (a C string ends at NUL: getaddrinfo and libzmq would read 127.0.0.9):
            # refused for every worker, allow-list or not
            for body, param in (({"role": "prefill", "url": "http://127.0.0.9\x00.allowed.test:1"}, "url"),
                                ({"role": "prefill", "url": "http://127.0.0.2:1",
                                  "kv_events": "tcp://127.0.0.9:5\x00.allowed.test:1"}, "kv_events"),
                                ({"role": "decode", "url": "http://127.0.0.2:1",
                                  "kv_addr": "tcp://127.0.0.9:5\x00.allowed.test:1"}, "kv_addr")):
                r = await admin(h, "POST", "", body)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
            assert set(await listed(h)) == {"p0", "d0"}                 # nothing was added
            for body in ({"role": "prefill", "url": "http://127.0.0.2:1", "kv_events": "tcp://127.0.0.2:5"},
                         {"role": "decode", "url": "http://127.0.0.3:1", "kv_addr": "ipc:///tmp/proserve-kv-x"},
                         {"role": "prefill", "url": "http://w-1.ALLOWED.test:1"}):
                r = await admin(h, "POST", "", body)
                assert r.status_code == 201, (body, r.text)
            assert set(await listed(h)) == {"p0", "d0", "p1", "d1", "p2"}
            assert (await h.post("/v1/completions", BODY)).status_code == 200   # the configured ones serve
    run(go())


def test_worker_hosts_config_and_cli():
    from proserve.dispatcher.cli import build_parser, config_from_args
    base = {"dispatcher": {"deployment": "colocated"}, "prefill": [{"url": "http://10.9.9.9:8100"}]}
    cfg = config_from_dict({**base, "dispatcher": {**base["dispatcher"], "worker_hosts": ["10.0.0.0/8", "fd00::1"]}})
    cfg.validate()                    # a configured worker is not checked against the list
    assert cfg.worker_hosts == ["10.0.0.0/8", "fd00::1"]
    for bad, msg in (("10.0.0.0/8", "must be a list"), (["10.0.0.0/33"], "not a network"),
                     (["10.1.2.3/8"], "host bits set"), (["a b"], "not an IP address"), ([""], "expected a host"),
                     ([7], "expected a host"), (["*."], "not an IP address"), (["10.1"], "not an IP address"),
                     (["2130706433"], "not an IP address")):
        cfg = config_from_dict({**base, "dispatcher": {**base["dispatcher"], "worker_hosts": bad}})
        with pytest.raises(ConfigError, match=msg):
            cfg.validate()
    args = build_parser().parse_args(["--deployment", "colocated", "--prefill", "http://127.0.0.1:8100",
                                      "--worker-hosts", "10.0.0.0/8, *.svc.cluster.local"])
    assert config_from_args(args).worker_hosts == ["10.0.0.0/8", "*.svc.cluster.local"]


def test_admin_add_is_refused_for_decode_when_colocated(admin_file):
    async def go():
        async with harness(colocated=True, admin_key_file=admin_file) as h:
            r = await admin(h, "POST", "", {"role": "decode", "url": "http://127.0.0.1:1",
                                            "kv_addr": "tcp://127.0.0.1:2"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "role"
    run(go())


# -- membership changes under load ----------------------------------------------------------------------
def test_add_a_decode_worker_mid_run(admin_file):
    async def go():
        async with harness(admin_key_file=admin_file) as h:
            traffic = Traffic(h).start()
            await traffic.more(10)
            # more KV memory than d0: once healthy, the decode pick (most free blocks) prefers it
            new = await FakeWorker(num_blocks=100_000).start()
            try:
                r = await admin(h, "POST", "", {"role": "decode", "url": new.url, "kv_addr": "tcp://127.0.0.1:16001"})
                assert r.status_code == 201, r.text
                w = r.json()
                assert w["name"] == "d1" and w["role"] == "decode" and w["source"] == "admin"
                await until(lambda: len(new.received) >= 5, 20, "the new decode worker to take requests")
                assert (await listed(h))["d1"]["state"] == "healthy"
                await traffic.more(10)
                statuses = await traffic.stop()
                assert statuses and all(s == 200 for s in statuses), statuses
                text = await h.metrics()
                assert metric(text, "proserve:dispatcher_membership_changes_total", role="decode", action="added",
                              source="admin") == 1
                assert metric(text, "proserve:dispatcher_routed_total", role="decode", instance="d1") >= 5
                assert metric(text, "proserve:dispatcher_instance_healthy", role="decode", instance="d1") == 1
                assert metric(text, "proserve:dispatcher_retries_total") == 0
            finally:
                await new.stop()
    run(go())


def test_drain_then_remove_a_prefill_worker_mid_run(admin_file):
    async def go():
        async with harness(n_prefill=2, admin_key_file=admin_file) as h:
            p0, p1 = h.prefills
            p0.hold = asyncio.Event()           # requests routed to p0 stay in flight there
            traffic = Traffic(h).start()
            await until(lambda: len(p0.received) >= 1, 20, "a request in flight on p0")
            r = await admin(h, "POST", "/p0/drain")
            assert r.status_code == 200, r.text
            assert r.json()["state"] == "draining" and r.json()["requests"] >= 1
            w0 = h.d.registry.prefill[0]
            routed = metric(await h.metrics(), "proserve:dispatcher_routed_total", role="prefill", instance="p0")
            held = w0.active          # routed there before the drain: each is (or will be) held at p0
            assert held == routed
            # busy: not removed without force
            r = await admin(h, "DELETE", "/p0")
            assert r.status_code == 409 and r.json()["error"]["code"] == "worker_busy"
            # nothing new goes to p0 while it drains; everything goes to p1
            before = len(p1.received)
            await until(lambda: len(p1.received) >= before + 15, 20, "requests on p1")
            await until(lambda: len(p0.received) == held, 10, "the requests routed to p0 before the drain to arrive")
            text = await h.metrics()
            assert metric(text, "proserve:dispatcher_routed_total", role="prefill", instance="p0") == routed
            assert w0.active == held and len(w0.state.queue) == held, "p0's queued entries stay until they finish"
            assert (await listed(h))["p0"]["requests"] == held
            assert metric(text, "proserve:dispatcher_instance_draining", role="prefill", instance="p0") == 1
            # its requests finish
            p0.hold.set()
            await until(lambda: h.d.registry.prefill[0].active == 0, 20, "p0's requests to finish")
            assert (await listed(h))["p0"]["requests"] == 0
            r = await admin(h, "DELETE", "/p0")
            assert r.status_code == 200, r.text
            assert r.json()["state"] == "removed"
            assert set(await listed(h)) == {"p1", "d0"}
            assert [p.id for p in h.d.router_host.qmap.instances] == [1]
            await traffic.more(10)
            statuses = await traffic.stop()
            assert len(statuses) >= 25 and all(s == 200 for s in statuses), statuses
            text = await h.metrics()
            assert metric(text, "proserve:dispatcher_retries_total") == 0
            assert metric(text, "proserve:dispatcher_requests_total", outcome="ok") == len(statuses)
            assert 'instance="p0"' not in "\n".join(x for x in text.splitlines()
                                                    if x.startswith("proserve:dispatcher_prefill_queue"))
            for action in ("drained", "removed"):
                assert metric(text, "proserve:dispatcher_membership_changes_total", role="prefill", action=action,
                              source="admin") == 1
    run(go())


def test_force_remove_lets_in_flight_requests_finish_and_ids_are_never_reused(admin_file):
    async def go():
        async with harness(n_prefill=2, admin_key_file=admin_file) as h:
            p0 = h.prefills[0]
            p0.hold = asyncio.Event()
            assert (await admin(h, "POST", "/p1/drain")).status_code == 200
            req = asyncio.create_task(h.post("/v1/completions", BODY))
            await until(lambda: len(p0.received) == 1, 10, "the request on p0")
            r = await admin(h, "POST", "/p1/resume")
            assert r.status_code == 200 and r.json()["state"] == "healthy"
            assert (await admin(h, "DELETE", "/p0")).status_code == 409
            r = await admin(h, "DELETE", "/p0?force=true")
            assert r.status_code == 200, r.text
            ws = await listed(h)
            assert ws["p0"]["state"] == "removed" and ws["p0"]["requests"] == 1   # listed until it is done
            assert (await h.post("/v1/completions", BODY)).status_code == 200   # new ones go to p1
            assert len(p0.received) == 1
            # the removed worker's id stays in the queue map while its request is queued there
            assert sorted(p.id for p in h.d.router_host.qmap.instances) == [0, 1]
            p0.hold.set()
            r = await asyncio.wait_for(req, 20)
            assert r.status_code == 200, r.text
            await until(lambda: "p0" not in {w.name for w in h.d.membership._everyone()}, 10, "p0 to go")
            assert "p0" not in await listed(h)
            assert [p.id for p in h.d.router_host.qmap.instances] == [1]
            # a new worker gets a new router id, also at a removed worker's URL
            r = await admin(h, "POST", "", {"role": "prefill", "url": p0.url, "local_policy": "vllm_fcfs"})
            assert r.status_code == 201, r.text
            w = h.d.registry.find(r.json()["name"])
            assert w.state.id == 2 and r.json()["name"] == "p2" and w.state.order == router_order("vllm_fcfs")
            await until(lambda: w.healthy, 10, "the new worker's first check")
            assert sorted(p.id for p in h.d.router_host.qmap.instances) == [1, 2]
            assert (await h.post("/v1/completions", BODY)).status_code == 200
            text = await h.metrics()
            assert metric(text, "proserve:dispatcher_retries_total") == 0
    run(go())


def test_an_added_worker_joins_only_once_healthy(admin_file):
    async def go():
        async with harness(admin_key_file=admin_file) as h:
            dead = f"http://127.0.0.1:{free_port()}"
            r = await admin(h, "POST", "", {"role": "prefill", "url": dead, "name": "ghost"})
            assert r.status_code == 201 and r.json()["state"] == "down"
            for _ in range(10):
                assert (await h.post("/v1/completions", BODY)).status_code == 200
            assert metric(await h.metrics(), "proserve:dispatcher_routed_total", instance="ghost") == 0
            assert (await listed(h))["ghost"]["state"] == "down"
            assert (await admin(h, "DELETE", "/ghost")).status_code == 200
    run(go())


# -- DNS discovery ------------------------------------------------------------------------------------------
async def pod(host: str, port: int, **kw) -> FakeWorker:
    """A fake worker on another loopback address (127.0.0.x: Linux routes all of 127/8 to lo)."""
    try:
        return await FakeWorker(host=host, port=port, **kw).start()
    except OSError as e:
        pytest.skip(f"cannot bind {host}:{port} ({e}): this system routes only 127.0.0.1 to loopback")


class FakeDNS:
    """An injected resolver: ``answer`` is what the name resolves to, or an exception to raise,
    or ``"hang"`` (never answers: the resolution's timeout must end it)."""

    def __init__(self, answer):
        self.answer = answer
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        if self.answer == "hang":
            await asyncio.Event().wait()
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)

    async def rounds(self, n: int = 3) -> None:
        goal = self.calls + n
        await until(lambda: self.calls >= goal, 20, f"{n} discovery rounds")


def test_discovery_follows_the_names_addresses(monkeypatch):
    async def go():
        port = free_port()
        # two "pods" behind one name, on the same port at different loopback addresses
        a = await pod("127.0.0.2", port)
        b = await pod("127.0.0.3", port, num_blocks=100_000)
        dns = FakeDNS(["127.0.0.2"])
        monkeypatch.setattr(membership, "resolve", dns)
        spec = DiscoverSpec(role="decode", host="decode.test", port=port, kv_port=15999, interval_s=0.05,
                            timeout_s=0.2)
        name_a, name_b = f"decode-127.0.0.2:{port}", f"decode-127.0.0.3:{port}"
        try:
            async with harness(n_decode=0, discover=[spec]) as h:
                ws = {w.name: w for w in h.d.registry.decode}
                assert set(ws) == {name_a} and ws[name_a].kv_addr == "tcp://127.0.0.2:15999"
                assert ws[name_a].source == "discover:decode.test"
                assert (await h.post("/v1/completions", BODY)).status_code == 200
                assert len(a.received) == 1
                # a new address joins
                dns.answer = ["127.0.0.3", "127.0.0.2"]
                await until(lambda: (w := h.d.registry.find(name_b)) is not None and w.state.free_blocks > 50_000,
                            20, "b to join (healthy, and its KV blocks read)")
                # a request held on b (most free KV blocks)
                b.hold = asyncio.Event()
                req = asyncio.create_task(h.post("/v1/completions", BODY))
                await until(lambda: len(b.received) == 1, 10, "a request on b")
                # b's address goes: drained, not removed while its request runs
                dns.answer = ["127.0.0.2"]
                await dns.rounds()
                wb = h.d.registry.find(name_b)
                assert wb is not None and wb.draining and wb.active == 1
                assert (await h.post("/v1/completions", BODY)).status_code == 200
                assert len(b.received) == 1 and len(a.received) == 2
                b.hold.set()
                assert (await asyncio.wait_for(req, 20)).status_code == 200
                await until(lambda: h.d.registry.find(name_b) is None, 10, "b to be removed")
                # failures keep the current set
                for answer, reason in ((OSError("name does not resolve"), "error"), ([], "empty"),
                                       ("hang", "timeout"), (["not-an-address"], "error")):
                    dns.answer = answer
                    await dns.rounds(2)
                    assert [w.name for w in h.d.registry.decode] == [name_a], reason
                    assert h.d.registry.find(name_a).routable
                    assert metric(await h.metrics(), "proserve:dispatcher_discovery_errors_total",
                                  host="decode.test", reason=reason) >= 1
                assert (await h.post("/v1/completions", BODY)).status_code == 200
                # the admin cannot delete a discovered worker: the next resolution would add it back
                from proserve.dispatcher.errors import ApiError
                with pytest.raises(ApiError) as e:
                    h.d.membership.remove(name_a)
                assert e.value.status == 409 and e.value.code == "worker_discovered"
                assert h.d.registry.find(name_a) is not None
                # b comes back
                dns.answer = ["127.0.0.2", "127.0.0.3"]
                await until(lambda: (w := h.d.registry.find(name_b)) is not None and w.healthy, 20, "b back")
                text = await h.metrics()
                assert metric(text, "proserve:dispatcher_membership_changes_total", role="decode", action="added",
                              source="discover") == 3
                assert metric(text, "proserve:dispatcher_membership_changes_total", role="decode",
                              action="removed", source="discover") == 1
                assert sorted(w.state.id for w in h.d.registry.decode) == [0, 2]   # b's old id 1 not reused
        finally:
            await a.stop()
            await b.stop()
    run(go())


def test_discovery_keeps_out_addresses_outside_worker_hosts(monkeypatch, caplog):
    """A name resolving to an address outside worker_hosts (a spoofed DNS answer): that
    address is logged and left out; the allowed ones join."""
    async def go():
        dns = FakeDNS(["127.0.0.2", "10.6.6.6"])
        monkeypatch.setattr(membership, "resolve", dns)
        spec = DiscoverSpec(role="decode", host="decode.test", port=8200, kv_port=15999, interval_s=0.05,
                            timeout_s=0.2)
        async with harness(n_decode=0, discover=[spec], worker_hosts=["127.0.0.2"]) as h:
            await dns.rounds(2)
            assert [w.name for w in h.d.registry.decode] == ["decode-127.0.0.2:8200"]
    with caplog.at_level("WARNING", logger="proserve.dispatcher"):
        run(go())
    assert any("10.6.6.6" in r.message and "worker_hosts" in r.message for r in caplog.records)


def test_discovery_of_prefill_workers_resumes_an_address_that_comes_back(monkeypatch):
    async def go():
        port = free_port()
        a = await pod("127.0.0.2", port)
        a.hold = asyncio.Event()
        dns = FakeDNS(["127.0.0.2"])
        monkeypatch.setattr(membership, "resolve", dns)
        spec = DiscoverSpec(role="prefill", host="prefill.test", port=port, interval_s=0.05, name_prefix="pf-",
                            local_policy="vllm_fcfs")
        try:
            async with harness(n_prefill=1, discover=[spec]) as h:
                name = f"pf-127.0.0.2:{port}"
                w = h.d.registry.find(name)
                assert w is not None and w.state.id == 1 and w.state.order == router_order("vllm_fcfs")
                await until(lambda: w.healthy, 10, "the discovered worker")
                h.d.registry.drain(h.d.registry.prefill[0])     # so that the next request goes to a
                req = asyncio.create_task(h.post("/v1/completions", BODY))
                await until(lambda: len(a.received) == 1, 10, "a request on the discovered worker")
                dns.answer = OSError("gone")
                await dns.rounds(2)
                assert not w.draining
                dns.answer = ["127.0.0.9"]      # its address went (the new one answers nothing)
                await until(lambda: w.draining, 10, "the worker to drain")
                dns.answer = ["127.0.0.2"]      # ... and came back before its request ended
                await until(lambda: not w.draining, 10, "the worker to resume")
                assert h.d.registry.find(name) is w
                a.hold.set()
                assert (await asyncio.wait_for(req, 20)).status_code == 200
        finally:
            await a.stop()
    run(go())


# -- configuration --------------------------------------------------------------------------------------------
def test_discover_config():
    cfg = config_from_dict({"dispatcher": {"admin_key_file": "admin.key"},
                            "discover": [{"role": "decode", "host": "decode.ns.svc.cluster.local", "port": 8200,
                                          "kv_port": 15600, "interval_s": 5},
                                         {"role": "prefill", "host": "prefill.ns.svc", "port": 8100,
                                          "local_policy": "vllm_fcfs", "latency_model": "m.json"}]},
                           base=__import__("pathlib").Path("/etc/proserve"))
    cfg.validate()      # no static workers: discovery supplies them
    assert cfg.admin_key_file == "/etc/proserve/admin.key"
    assert cfg.discover[0].kv_port == 15600 and cfg.discover[1].latency_model == "/etc/proserve/m.json"
    bad = [
        ({"role": "decode", "host": "d.svc", "port": 8200}, "kv_port"),
        ({"role": "router", "host": "d.svc", "port": 8200}, "role"),
        ({"role": "prefill", "host": "bad host!", "port": 8200}, "host"),
        ({"role": "prefill", "host": "p.svc", "port": 0}, "port"),
        ({"role": "prefill", "host": "p.svc", "port": 8100, "interval_s": 0}, "interval_s"),
        ({"role": "prefill", "host": "p.svc", "port": 8100, "scheme": "ftp"}, "scheme"),
        ({"role": "prefill", "host": "p.svc", "port": 8100, "local_policy": "nope"}, "local_policy"),
        ({"role": "prefill", "host": "p.svc"}, "needs role, host and port"),
        ({"role": "prefill", "host": "p.svc", "port": 8100, "extra": 1}, "unknown"),
    ]
    for entry, what in bad:
        with pytest.raises(ConfigError, match=what):
            config_from_dict({"discover": [entry], "prefill": [{"url": "http://127.0.0.1:8100"}],
                              "decode": [{"url": "http://127.0.0.1:8200", "kv_addr": "tcp://127.0.0.1:1"}]}
                             ).validate()
    with pytest.raises(ConfigError, match="colocated"):
        config_from_dict({"dispatcher": {"deployment": "colocated"},
                          "discover": [{"role": "decode", "host": "d.svc", "port": 1, "kv_port": 2}],
                          "prefill": [{"url": "http://127.0.0.1:8100"}]}).validate()
    with pytest.raises(ConfigError, match="no prefill instances"):
        config_from_dict({"discover": [{"role": "decode", "host": "d.svc", "port": 1, "kv_port": 2}]}).validate()


def test_cli_admin_key_file_and_an_empty_pool(admin_file):
    from proserve.dispatcher.cli import build_parser, config_from_args
    cfg = config_from_args(build_parser().parse_args(["--deployment", "colocated", "--admin-key-file", admin_file]))
    assert cfg.admin_key_file == admin_file and not cfg.prefill    # workers come through the admin API
    assert Dispatcher(cfg).admin_key == ADMIN
    with pytest.raises(ConfigError, match="no prefill instances"):
        config_from_args(build_parser().parse_args(["--deployment", "colocated"]))
