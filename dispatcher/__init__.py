"""Global dispatcher: an OpenAI-compatible HTTP API that routes priority-tagged
requests over prefill/decode worker pools with GoRouting (``python -m proserve.dispatcher``)."""
