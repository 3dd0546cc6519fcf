"""``python -m proserve.bench.loadgen``: runs :func:`proserve.bench.loadgen.cli.main` and exits with its status."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
