"""``python -m decode``: start a decode worker (see ``prefill.worker``)."""

from prefill.worker import main

if __name__ == "__main__":
    main("decode")
