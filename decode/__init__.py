"""Decode worker: a vLLM engine with the consumer side of ``kvtransfer`` that
reports its free KV blocks to the dispatcher. Filled in by the worker-pool issue."""
