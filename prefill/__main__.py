"""``python -m proserve.prefill``: start a prefill worker (see ``proserve.prefill.worker``)."""

from .worker import main

if __name__ == "__main__":
    main("prefill")
