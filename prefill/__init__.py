"""Prefill worker: a vLLM engine whose batches are formed by SlideBatching
(``scheduler_cls`` plugin) and whose KV connector is the producer side of
``kvtransfer``. Filled in by the worker-pool and scheduler-plugin issues."""
