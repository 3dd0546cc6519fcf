"""The KV connector with its forward-thread hooks timed, for scripts/bench_kv_step.py.

Loaded by vLLM as ``kv_connector_module_path = "bench_kv_hooks"`` (``scripts/`` on
``PYTHONPATH``): a subclass of the ``ProServeConnector`` of the package named in
``PROSERVE_BENCH_KV_PKG`` (default ``proserve.kvtransfer``) that adds up, per
engine step, the time the forward thread spends in ``save_kv_layer``,
``wait_for_save`` and ``get_transfer_results``, and appends one JSON line per step to ``PROSERVE_BENCH_HOOKS_OUT``:
``{"saves": n, "save_s", "wait_s", "finished_s"}``. That is how long the
forward pass waited for the KV path, whatever else the host was doing.
"""
from __future__ import annotations

import importlib
import json
import os
import time

_base = importlib.import_module(os.environ.get("PROSERVE_BENCH_KV_PKG", "proserve.kvtransfer") + ".connector")


class ProServeConnector(_base.ProServeConnector):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._bench = {"saves": 0, "save_s": 0.0, "wait_s": 0.0}
        self._bench_out = os.environ.get("PROSERVE_BENCH_HOOKS_OUT")

    def save_kv_layer(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return super().save_kv_layer(*a, **kw)
        finally:
            self._bench["saves"] += 1
            self._bench["save_s"] += time.perf_counter() - t0

    def wait_for_save(self):
        t0 = time.perf_counter()
        try:
            return super().wait_for_save()
        finally:
            self._bench["wait_s"] += time.perf_counter() - t0

    def get_transfer_results(self, finished_req_ids):
        # vLLM 0.32 calls this once per step, after the forward pass (both copies define it)
        t0 = time.perf_counter()
        try:
            return super().get_transfer_results(finished_req_ids)
        finally:
            b, self._bench = self._bench, {"saves": 0, "save_s": 0.0, "wait_s": 0.0}
            b["finished_s"] = time.perf_counter() - t0
            if self._bench_out:
                with open(self._bench_out, "a") as f:
                    f.write(json.dumps(b) + "\n")
