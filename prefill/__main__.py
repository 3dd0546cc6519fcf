"""``python -m prefill``: start a prefill worker (see ``prefill.worker``)."""

from .worker import main

if __name__ == "__main__":
    main("prefill")
