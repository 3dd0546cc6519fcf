"""CURVE keys for the KV transport (ZeroMQ CURVE encryption + authentication).

A :class:`~proserve.kvtransfer.receiver.KVReceiver` given :class:`ServerKeys` is a CURVE
server: every connection is encrypted, and a ZAP authenticator admits only the
client public keys found in ``DIR/clients/``. A
:class:`~proserve.kvtransfer.sender.KVSender` given :class:`ClientKeys` is a CURVE
client with its own key pair, and checks the receiver's identity against the
server public key. Without keys the transport only talks over loopback
(:func:`is_loopback`), unless explicitly allowed.

Key directory layout (created by :func:`generate_keys`, or
``python -m proserve.kvtransfer.keys DIR``; files 0600, directories 0700)::

    DIR/server.key          server public certificate (zmq.auth format)
    DIR/server.key_secret   server secret certificate   -> decode hosts
    DIR/client.key          client public certificate
    DIR/client.key_secret   client secret certificate   -> prefill hosts
    DIR/clients/client.key  allowed client public keys: every *.key in
                            DIR/clients is accepted by receivers

A decode host (receiver) needs ``server.key_secret`` and ``clients/``; a
prefill host (sender) needs ``client.key_secret`` and ``server.key``. Several
client key pairs can be admitted by dropping more public ``*.key`` files into
``clients/`` (on the decode hosts) -- each prefill host can then have its own.
The files use pyzmq's certificate format (``zmq.auth.load_certificate`` reads
them).
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import pathlib
import stat
from dataclasses import dataclass, field

import zmq
import zmq.auth
import zmq.utils.z85

log = logging.getLogger("proserve.kvtransfer.auth")

SERVER_PUBLIC = "server.key"
SERVER_SECRET = "server.key_secret"
CLIENT_PUBLIC = "client.key"
CLIENT_SECRET = "client.key_secret"
CLIENTS_DIR = "clients"

_BANNER = """#   ****  Generated on {date} by kvtransfer.auth  ****
#   ZeroMQ CURVE {what} Certificate
{warning}
"""


class KeysError(ValueError):
    """A key file or directory is missing, unreadable or malformed (the message
    names the path)."""


@dataclass(frozen=True)
class ServerKeys:
    """What a receiver needs: its own key pair (z85 bytes) and the public keys
    of the clients it admits."""
    public: bytes
    secret: bytes = field(repr=False)
    allowed_clients: frozenset = frozenset()

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "ServerKeys":
        """Read ``DIR/server.key_secret`` and every ``DIR/clients/*.key``. Raises
        :class:`KeysError` naming the missing/bad file, or when ``clients/``
        holds no key (no sender could ever connect)."""
        d = pathlib.Path(directory)
        public, secret = _load_pair(d / SERVER_SECRET)
        clients_dir = d / CLIENTS_DIR
        if not clients_dir.is_dir():
            raise KeysError(f"{clients_dir}: missing (directory of allowed client public keys, *.key)")
        allowed = set()
        for f in sorted(clients_dir.glob("*.key")):
            allowed.add(_load_public(f))
        if not allowed:
            raise KeysError(f"{clients_dir}: no *.key files (no client would be admitted)")
        return cls(public, secret, frozenset(allowed))


@dataclass(frozen=True)
class ClientKeys:
    """What a sender needs: its own key pair and the receivers' (server) public
    key, all z85 bytes."""
    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes = b""

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "ClientKeys":
        """Read ``DIR/client.key_secret`` and ``DIR/server.key``; raises
        :class:`KeysError` naming the missing/bad file."""
        d = pathlib.Path(directory)
        public, secret = _load_pair(d / CLIENT_SECRET)
        return cls(public, secret, _load_public(d / SERVER_PUBLIC))


def generate_keys(directory: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Create a server and a client key pair in ``directory`` (layout in the
    module doc). Refuses (:class:`KeysError`) when any of the files exists,
    unless ``overwrite=True``. Secret files are created 0600 from the start
    (never world-readable, not even briefly), directories 0700."""
    d = pathlib.Path(directory)
    targets = [d / SERVER_PUBLIC, d / SERVER_SECRET, d / CLIENT_PUBLIC, d / CLIENT_SECRET,
               d / CLIENTS_DIR / CLIENT_PUBLIC]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not overwrite:
        raise KeysError(f"refusing to overwrite existing key files: {', '.join(existing)} (pass overwrite=True)")
    for sub in (d, d / CLIENTS_DIR):
        sub.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(sub, 0o700)
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    _write_cert(d / SERVER_PUBLIC, "Public", server_pub)
    _write_cert(d / SERVER_SECRET, "**Secret**", server_pub, server_sec)
    _write_cert(d / CLIENT_PUBLIC, "Public", client_pub)
    _write_cert(d / CLIENT_SECRET, "**Secret**", client_pub, client_sec)
    _write_cert(d / CLIENTS_DIR / CLIENT_PUBLIC, "Public", client_pub)


def is_loopback(address: str) -> bool:
    """True when ``address`` cannot leave this host: ``ipc://`` and ``inproc://``
    endpoints, and ``tcp://`` to 127.0.0.0/8, ``::1`` or ``localhost``. Anything
    else (other hosts, ``*``, ``0.0.0.0``, interface names, unparsable) is
    False."""
    if not isinstance(address, str):
        return False
    if address.startswith(("ipc://", "inproc://")):
        return True
    if not address.startswith("tcp://"):
        return False
    rest = address[len("tcp://"):]
    if ";" in rest:  # "source;destination" form: judge the destination
        rest = rest.rsplit(";", 1)[1]
    host, sep, port = rest.rpartition(":")
    if not sep or not port:
        return False
    return is_loopback_host(host)


def is_loopback_host(host: str) -> bool:
    """True when an HTTP server bound to ``host`` cannot be reached from another host:
    ``localhost``, 127.0.0.0/8, ``::1`` (bracketed or not). ``0.0.0.0``, ``::``, other
    addresses and names are False."""
    if not isinstance(host, str):
        return False
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------ internals


def _write_cert(path: pathlib.Path, what: str, public: bytes, secret: bytes | None = None) -> None:
    """Write one certificate in zmq.auth's format, atomically (tmp + rename), with
    mode 0600 from creation."""
    warning = ("#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions."
               if secret is not None else "#   THIS IS A PUBLIC KEY; it can be shared.")
    text = _BANNER.format(date=datetime.datetime.now().isoformat(timespec="seconds"), what=what, warning=warning)
    text += "metadata\ncurve\n"
    text += f'    public-key = "{public.decode("ascii")}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode("ascii")}"\n'
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _load_pair(path: pathlib.Path) -> tuple[bytes, bytes]:
    public, secret = _read(path)
    if not secret:
        raise KeysError(f"{path}: no secret-key in this certificate (is it the public .key file?)")
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("kvtransfer: secret key file %s is accessible by group/others (mode %o); chmod 600 it",
                        path, stat.S_IMODE(mode))
    except OSError:
        pass
    return public, secret


def _load_public(path: pathlib.Path) -> bytes:
    return _read(path)[0]


def _read(path: pathlib.Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeysError(f"{path}: missing key file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeysError(f"{path}: cannot read a CURVE certificate ({e})") from None
    for name, key in (("public-key", public), ("secret-key", secret)):
        if key is not None and not _valid_z85_key(key):
            raise KeysError(f"{path}: {name} is not a 40-character Z85 CURVE key")
    return public, secret


def _valid_z85_key(key: bytes) -> bool:
    if len(key) != 40:
        return False
    try:
        zmq.utils.z85.decode(key)
        return True
    except Exception:
        return False


__all__ = ["generate_keys", "ServerKeys", "ClientKeys", "KeysError", "is_loopback", "is_loopback_host"]
