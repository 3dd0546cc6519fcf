"""ProServe's KV-cache transfer between prefill and decode engines.

* :mod:`proserve.kvtransfer.transport` -- the engine-agnostic ZeroMQ transport
  (:class:`~proserve.kvtransfer.sender.KVSender`, :class:`~proserve.kvtransfer.receiver.KVReceiver`;
  design, bounds and failure handling in its module doc), with
  :mod:`proserve.kvtransfer.wire` (the message format), :mod:`proserve.kvtransfer.sender`,
  :mod:`proserve.kvtransfer.receiver` and :mod:`proserve.kvtransfer.common`.
* :mod:`proserve.kvtransfer.auth` -- CURVE keys and the loopback check;
  ``python -m proserve.kvtransfer.keys DIR`` generates a key directory.
* :mod:`proserve.kvtransfer.connector` -- the vLLM ``KVConnectorBase_V1`` that pushes KV
  blocks from a prefill engine to a decode engine over the transport.

Nothing is imported here, so using the transport does not import vLLM.
"""
