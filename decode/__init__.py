"""Decode worker: a vLLM engine with the consumer side of ``kvtransfer`` (it
receives each request's KV from a prefill worker and generates the rest).
``python -m proserve.decode`` starts one (the launcher is shared with the prefill worker:
``proserve.prefill.worker``); :mod:`proserve.decode.status` reads its free KV blocks for the
dispatcher."""
