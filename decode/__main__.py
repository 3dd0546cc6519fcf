"""``python -m proserve.decode``: start a decode worker (see ``proserve.prefill.worker``)."""

from proserve.prefill.worker import main

if __name__ == "__main__":
    main("decode")
