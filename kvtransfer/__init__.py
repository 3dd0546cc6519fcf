"""ProServe's KV-cache transfer between prefill and decode engines.

* :mod:`kvtransfer.transport` -- the engine-agnostic ZeroMQ transport
  (:class:`~kvtransfer.sender.KVSender`, :class:`~kvtransfer.receiver.KVReceiver`;
  design, bounds and failure handling in its module doc), with
  :mod:`kvtransfer.wire` (the message format), :mod:`kvtransfer.sender`,
  :mod:`kvtransfer.receiver` and :mod:`kvtransfer.common`.
* :mod:`kvtransfer.auth` -- CURVE keys and the loopback check;
  ``python -m kvtransfer.keys DIR`` generates a key directory.
* :mod:`kvtransfer.connector` -- the vLLM ``KVConnectorBase_V1`` that pushes KV
  blocks from a prefill engine to a decode engine over the transport.

Nothing is imported here, so using the transport does not import vLLM.
"""
