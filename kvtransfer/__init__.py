"""ZeroMQ KV-cache transport and the vLLM ``KVConnectorBase_V1`` built on it.
Filled in by the worker-pool issue."""
