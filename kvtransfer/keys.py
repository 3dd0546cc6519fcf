"""Generate CURVE keys for the KV transport::

    python -m proserve.kvtransfer.keys DIR [--overwrite]

creates ``DIR/server.key``, ``DIR/server.key_secret``, ``DIR/client.key``,
``DIR/client.key_secret`` and ``DIR/clients/client.key`` (see
:mod:`proserve.kvtransfer.auth` for the layout) and prints which files go to which
hosts. Existing keys are never overwritten unless ``--overwrite`` is given.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

from .auth import CLIENT_PUBLIC, CLIENT_SECRET, CLIENTS_DIR, SERVER_PUBLIC, SERVER_SECRET, KeysError, generate_keys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m proserve.kvtransfer.keys", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", help="where to create the keys (created 0700 if missing)")
    ap.add_argument("--overwrite", action="store_true", help="replace existing key files")
    args = ap.parse_args(argv)
    d = pathlib.Path(args.directory)
    try:
        generate_keys(d, overwrite=args.overwrite)
    except (KeysError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"""CURVE keys written to {d}/ (secret files are mode 0600; keep them so)

decode hosts (KVReceiver, ServerKeys.load(DIR)) need:
    {d / SERVER_SECRET}
    {d / CLIENTS_DIR}/            (every *.key in it is an admitted client)
prefill hosts (KVSender, ClientKeys.load(DIR)) need:
    {d / CLIENT_SECRET}
    {d / SERVER_PUBLIC}
public, may be shared:
    {d / SERVER_PUBLIC}, {d / CLIENT_PUBLIC}

Copy the same DIR to every host if they all run under one trust domain, or give
each prefill host its own pair: run this again elsewhere and put that
{CLIENT_PUBLIC} (renamed, e.g. prefill-1.key) into {CLIENTS_DIR}/ on the decode hosts.""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
