"""Wire format of the ZeroMQ KV-cache transport (version 3).

Every message is a multipart ZeroMQ message::

    frame 0      msgpack-encoded header (a map with str keys)
    frame 1      raw tensor bytes (only ``kv`` messages carry one; all others none)

Nothing is ever pickled: the header is plain msgpack (str/int/bool/list/map only),
the payload the C-contiguous, little-endian bytes of the message's parts.

Header fields common to every kind: ``v`` (int, must be 3; a peer speaking
another version is refused with ``bad_version``) and ``kind`` (str).
A transfer id (``xfer``) is always a non-empty str of at most
:data:`MAX_XFER_LEN` characters (any other value makes the whole message
malformed); ``reason`` strings are at most :data:`MAX_REASON_LEN` characters.
The other fields depend on the kind; a header must carry exactly these fields,
no more and no less, each of the stated type (``bool`` is never accepted where an
``int`` is expected; an "index" is an int in ``0..MAX_INDEX``):

sender -> receiver

``hello``  ``layout: str``
    First message on a new connection; the receiver answers with the initial
    ``credit`` grant (see ``transport`` for the flow-control scheme), or with
    ``refuse`` when it cannot take this sender's KV. ``layout`` (at most
    :data:`MAX_REASON_LEN` characters, empty when unused) is opaque to the
    transport: the receiver's ``check_layout`` callable judges it (the vLLM
    connector puts the sender's KV layout there -- tensor-parallel size and
    rank, block size, dtype, block shape, layer count -- so that a prefill and
    a decode engine that cannot exchange KV find out at the first contact).
``kv``     ``xfer: str, nbytes: int>=0, parts: [part]`` (1..:data:`MAX_PARTS` parts)
    KV of transfer ``xfer`` (the transfer id the caller issued: the
    dispatcher's id, never an engine-internal request id). The payload frame
    holds the parts' bytes back to back, in the order of ``parts``;
    ``nbytes == len(payload frame) == sum of the parts' sizes``. A message is
    either one chunk of a large layer or several whole small layers packed
    together (so that per-message costs do not dominate small transfers). A
    part is a map::

        step: index, layer: index, seq: index, blocks: [int>=0], dtype: str,
        shape: [int>=0], offset: int>=0, lshape: [int>=0]

    One chunk of the KV that engine step ``step`` computed for layer
    ``layer`` (a prompt prefilled in several chunks sends each layer once per
    step; ``(step, layer)`` names a *piece* of the transfer). ``seq`` is the
    chunk index within the piece (0, 1, ...). ``shape`` is the shape of this
    chunk, ``lshape`` the shape of the whole piece, ``offset`` the byte offset
    of this chunk within the piece's C-contiguous bytes; the part's size is
    ``prod(shape) * itemsize(dtype)`` and ``offset + size <= prod(lshape) *
    itemsize``. ``blocks`` are the block ids the caller passed for the piece,
    in the *sender's* numbering (the vLLM connector sends logical block
    positions within the request; the transport does not interpret them).
    When the piece's leading axis is the block axis (``lshape[0] ==
    len(blocks)``) and it is split along that axis, each chunk carries only
    the block ids of its own rows; otherwise every chunk carries the full
    list. ``dtype`` comes from :data:`DTYPES`.
``done``   ``xfer: str, chunks: int>=0, layers: int>=0, nbytes: int>=0, digest: str``
    Closes a transfer, announcing how many parts (``chunks``), distinct
    ``(step, layer)`` pieces (``layers``) and payload bytes were sent, so the
    receiver can tell a complete transfer from a truncated one. ``digest``
    (0..128 chars of ``[0-9a-f]``, empty when unused) is opaque to the
    transport: the sender's caller passes it to ``KVSender.finish`` and the
    receiver hands it over as ``TransferResult.digest`` (the vLLM connector
    puts a digest of the prompt's token ids there, to bind the transfer to
    its request).
``abort``  ``xfer: str, reason: str``
    The receiver drops whatever it holds for ``xfer``.

receiver -> sender

``credit`` ``bytes: int>=0, init: bool, max_message: int>0``
    Flow-control grant. ``init`` is true on the answer to ``hello`` (``bytes`` is
    then the whole window), false on later returns of consumed credit.
``ack``    ``xfer: str, chunks: int>=0, nbytes: int>=0``
    The transfer was received in full (and, with an ``on_chunk`` callback,
    written to its destination); the sender may free its KV blocks.
``nack``   ``xfer: str, reason: str``
    The transfer failed on the receiver side (truncated, aborted, abandoned,
    chunk rejected, ...).
``refuse`` ``reason: str``
    The answer to ``hello`` when the receiver will take no KV from this
    sender (its ``layout`` does not fit the receiver's engine). The sender
    drops the connection and fails every transfer to this receiver with the
    reason. A check of configuration, not of identity: authentication is
    CURVE's job.

Version history: 1 had one chunk per ``kv`` message, with the chunk's fields in
the header itself and no ``step`` (the vLLM connector folded the step into
``layer``). Version 2 (this one) gives the step its own field and packs
several parts into one message. Version 3 adds ``hello``'s ``layout`` and the
``refuse`` answer.
"""
from __future__ import annotations

import math
import reprlib
from typing import Any, Sequence

import msgpack
import zmq

VERSION = 3

#: Allowed ``dtype`` strings and their item sizes in bytes.
DTYPES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

#: Largest accepted header (frame 0), bytes.
MAX_HEADER_BYTES = 1 << 20
#: Largest accepted ``shape``/``lshape`` rank and ``blocks``/``xfer`` lengths.
MAX_NDIM = 16
MAX_BLOCKS = 1 << 20
MAX_XFER_LEN = 512
MAX_REASON_LEN = 4096
#: Most parts in one ``kv`` message.
MAX_PARTS = 4096
#: Largest ``step``/``layer``/``seq`` (an "index" field).
MAX_INDEX = (1 << 31) - 1
#: Longest ``digest`` of a ``done`` message (lower-case hex, possibly empty).
MAX_DIGEST_LEN = 128
_HEX = frozenset("0123456789abcdef")

#: msgpack limits for a header (bounded work and memory for any frame 0)
_UNPACK_LIMITS = {"raw": False, "strict_map_key": True, "use_list": True, "max_str_len": MAX_HEADER_BYTES,
                  "max_bin_len": 0, "max_ext_len": 0, "max_array_len": MAX_BLOCKS, "max_map_len": 64}

SENDER_KINDS = ("hello", "kv", "done", "abort")
RECEIVER_KINDS = ("credit", "ack", "nack", "refuse")

# field -> type tag; "int" = non-negative int (never bool), "index" = int in 0..MAX_INDEX,
# "ints" = list of non-negative ints, "parts" = list of PART_FIELDS maps.
_FIELDS: dict[str, dict[str, str]] = {
    "hello": {"layout": "str"},
    "kv": {"xfer": "xfer", "nbytes": "int", "parts": "parts"},
    "done": {"xfer": "xfer", "chunks": "int", "layers": "int", "nbytes": "int", "digest": "digest"},
    "abort": {"xfer": "xfer", "reason": "str"},
    "credit": {"bytes": "int", "init": "bool", "max_message": "int"},
    "ack": {"xfer": "xfer", "chunks": "int", "nbytes": "int"},
    "nack": {"xfer": "xfer", "reason": "str"},
    "refuse": {"reason": "str"},
}
#: The fields of one part of a ``kv`` message.
PART_FIELDS: dict[str, str] = {"step": "index", "layer": "index", "seq": "index", "blocks": "ints",
                               "dtype": "dtype", "shape": "shape", "offset": "int", "lshape": "shape"}
_PAYLOAD_FRAMES = {"kv": 1}


def valid_xfer(x: Any) -> bool:
    """True for a well-formed transfer id: a non-empty str of at most
    :data:`MAX_XFER_LEN` characters."""
    return type(x) is str and 0 < len(x) <= MAX_XFER_LEN


def valid_digest(d: Any) -> bool:
    """True for a well-formed ``done`` digest: a str of at most
    :data:`MAX_DIGEST_LEN` lower-case hex digits (empty allowed)."""
    return type(d) is str and len(d) <= MAX_DIGEST_LEN and _HEX.issuperset(d)


class WireError(ValueError):
    """A malformed message. ``reason`` is a short token used as a stats key; the
    message names the offending field. ``xfer`` is the transfer id when the
    header got far enough to tell it, and only ever a *valid* one
    (:func:`valid_xfer`; anything else is ``None``), so a receiver can always
    name it in a ``nack``."""

    def __init__(self, reason: str, detail: str, xfer: Any = None):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.xfer: str | None = xfer if valid_xfer(xfer) else None


class Message:
    """A validated message: ``kind``, ``header`` (the dict), ``payload`` (a tuple
    of zero or one memoryview). For a ``kv`` message, ``sizes`` holds each
    part's payload size in bytes (in the order of ``header["parts"]``)."""
    __slots__ = ("kind", "header", "payload", "sizes")

    def __init__(self, kind: str, header: dict, payload: tuple, sizes: list[int] | None = None):
        self.kind = kind
        self.header = header
        self.payload = payload
        self.sizes = sizes

    def __getitem__(self, key):
        return self.header[key]


def itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported dtype {dtype!r}; allowed: {', '.join(DTYPES)}") from None


def prod(shape: Sequence[int]) -> int:
    return math.prod(shape)


def encode(kind: str, **fields: Any) -> bytes:
    """Pack a header. Fields are checked with the same rules as on receive, so a
    bug on the sending side fails loudly here instead of on the peer."""
    header = {"v": VERSION, "kind": kind, **fields}
    _check_header(header, SENDER_KINDS + RECEIVER_KINDS)
    return msgpack.packb(header, use_bin_type=True)


def part(step: int, layer: int, seq: int, blocks: list, dtype: str, shape: list, offset: int,
         lshape: list) -> dict:
    """One part of a ``kv`` message (see the module doc)."""
    return {"step": step, "layer": layer, "seq": seq, "blocks": blocks, "dtype": dtype, "shape": shape,
            "offset": offset, "lshape": lshape}


def encode_kv(xfer: str, parts: list[dict], nbytes: int) -> bytes:
    """Fast path for the sender's ``kv`` header (its inputs are validated by
    ``KVSender.send_layer``; the receiver validates everything again)."""
    return msgpack.packb({"v": VERSION, "kind": "kv", "xfer": xfer, "nbytes": nbytes, "parts": parts},
                         use_bin_type=True)


def decode(frames: Sequence[Any], kinds: Sequence[str], max_message_bytes: int | None = None) -> Message:
    """Parse and strictly validate one multipart message (without routing id).

    ``frames`` are bytes-like objects or ``zmq.Frame``s; ``kinds`` the kinds this
    side accepts. Raises :class:`WireError` on anything malformed.
    """
    if not frames:
        raise WireError("frame_count", "empty message")
    # zmq.Frame and bytes both have len() in bytes; other buffers go through memoryview
    frames = [f if isinstance(f, (zmq.Frame, bytes)) else memoryview(f).cast("B") for f in frames]
    total = sum(map(len, frames))
    head = frames[0]
    if isinstance(head, zmq.Frame):
        head = head.bytes if len(head) <= MAX_HEADER_BYTES else head.buffer
    if max_message_bytes is not None and total > max_message_bytes:
        raise WireError("too_large", f"message of {total} bytes exceeds the limit of {max_message_bytes}",
                        xfer=_peek_xfer(head))
    if len(head) > MAX_HEADER_BYTES:
        raise WireError("too_large", f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head, **_UNPACK_LIMITS)
    except Exception as e:  # msgpack raises several exception types
        raise WireError("bad_msgpack", f"header is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise WireError("bad_header", f"header must be a map, got {type(header).__name__}")
    if not (header.get("kind") == "kv" and "kv" in kinds and _kv_header_ok(header)):
        _check_header(header, kinds)  # the general checker (and the precise error message)
    kind = header["kind"]
    want = _PAYLOAD_FRAMES.get(kind, 0)
    if len(frames) - 1 != want:
        raise WireError("frame_count", f"'{kind}' message needs {want} payload frame(s), got {len(frames) - 1}",
                        xfer=header.get("xfer"))
    payload = tuple(f.buffer if isinstance(f, zmq.Frame) else memoryview(f) for f in frames[1:])
    if kind == "kv":
        return Message(kind, header, payload, _check_kv(header, payload[0]))
    return Message(kind, header, payload)


_INT_ONLY = {int}


def _nonneg_ints(xs) -> bool:
    return type(xs) is list and (not xs or (set(map(type, xs)) == _INT_ONLY and min(xs) >= 0))


def _index_ok(x) -> bool:
    return type(x) is int and 0 <= x <= MAX_INDEX


def _part_ok(p) -> bool:
    """Fast acceptance test for a well-formed part (same rules as :func:`_check_part`)."""
    if type(p) is not dict or len(p) != 8:
        return False
    try:
        step, layer, seq, blocks = p["step"], p["layer"], p["seq"], p["blocks"]
        dtype, shape, offset, lshape = p["dtype"], p["shape"], p["offset"], p["lshape"]
    except KeyError:
        return False
    return (_index_ok(step) and _index_ok(layer) and _index_ok(seq)
            and type(offset) is int and offset >= 0 and type(dtype) is str and dtype in DTYPES
            and _nonneg_ints(blocks)
            and _nonneg_ints(shape) and len(shape) <= MAX_NDIM
            and _nonneg_ints(lshape) and len(lshape) <= MAX_NDIM)


def _kv_header_ok(h: dict) -> bool:
    """Fast acceptance test for a well-formed ``kv`` header (same rules as
    :func:`_check_header`; anything it does not accept goes through that)."""
    if len(h) != 5:
        return False
    try:
        v, x, nbytes, parts = h["v"], h["xfer"], h["nbytes"], h["parts"]
    except KeyError:
        return False
    return (type(v) is int and v == VERSION and type(x) is str and 0 < len(x) <= MAX_XFER_LEN
            and type(nbytes) is int and nbytes >= 0
            and type(parts) is list and 0 < len(parts) <= MAX_PARTS and all(map(_part_ok, parts)))


def _peek_xfer(head: memoryview) -> str | None:
    """Best-effort transfer id of an oversized message (to fail its transfer). Only a
    header of a size :func:`proserve.decode` accepts is looked at, with its limits: the whole
    message may be far larger (a frame up to ``ZMQ_MAXMSGSIZE``), and unpacking, say,
    64 MB of one-byte empty arrays would build ~4 GB of Python lists on the receiver
    thread."""
    if len(head) > MAX_HEADER_BYTES:
        return None
    try:
        h = msgpack.unpackb(head, **_UNPACK_LIMITS)
        x = h.get("xfer") if isinstance(h, dict) else None
        return x if valid_xfer(x) else None
    except Exception:
        return None


def _check_header(h: dict, kinds: Sequence[str]) -> None:
    xfer = h.get("xfer") if valid_xfer(h.get("xfer")) else None   # to name it in a nack
    if "v" not in h:
        raise WireError("missing_field", "field 'v' is missing", xfer)
    if type(h["v"]) is not int or h["v"] != VERSION:
        raise WireError("bad_version", f"field 'v': this side speaks wire version {VERSION}, the peer sent "
                                       f"{reprlib.repr(h['v'])} (both ends must run the same kvtransfer version)",
                        xfer)
    kind = h.get("kind")
    if kind not in kinds or not isinstance(kind, str):
        raise WireError("bad_kind", f"field 'kind': expected one of {list(kinds)}, got {reprlib.repr(kind)}", xfer)
    _check_fields(h, _FIELDS[kind], f"a '{kind}' header", xfer, extra=("v", "kind"))


def _check_fields(h: dict, spec: dict[str, str], what: str, xfer, extra: tuple = ()) -> None:
    if len(h) != len(spec) + len(extra):
        for name in h:
            if name not in spec and name not in extra:
                raise WireError("unknown_field", f"field {reprlib.repr(name)} is not allowed in {what}", xfer)
    for name, tag in spec.items():
        if name not in h:
            raise WireError("missing_field", f"field {name!r} is missing from {what}", xfer)
        _check_field(name, tag, h[name], xfer)


def _bad(name: str, x, expected: str, xfer) -> WireError:
    shown = reprlib.repr(x)  # bounded work even for a million-element list
    return WireError("bad_field", f"field {name!r}: expected {expected}, got {type(x).__name__} {shown}", xfer)


def _check_field(name: str, tag: str, x, xfer) -> None:
    t = type(x)
    if tag == "int":
        if t is not int or x < 0:
            raise _bad(name, x, "int >= 0", xfer)
    elif tag == "index":
        if not _index_ok(x):
            raise _bad(name, x, f"int in 0..{MAX_INDEX}", xfer)
    elif tag == "ints":
        if t is not list or not all(type(d) is int and d >= 0 for d in x):
            raise _bad(name, x, "list of ints >= 0", xfer)
    elif tag == "shape":
        if t is not list or len(x) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in x):
            raise _bad(name, x, f"list of at most {MAX_NDIM} ints >= 0", xfer)
    elif tag == "xfer":
        if not valid_xfer(x):
            raise _bad(name, x, f"non-empty str of at most {MAX_XFER_LEN} chars", xfer)
    elif tag == "digest":
        if not valid_digest(x):
            raise _bad(name, x, f"str of at most {MAX_DIGEST_LEN} lower-case hex digits", xfer)
    elif tag == "dtype":
        if t is not str:
            raise _bad(name, x, "dtype name (str)", xfer)
        if x not in DTYPES:
            raise WireError("bad_dtype", f"field {name!r}: dtype {x!r} is not in the allow-list {list(DTYPES)}", xfer)
    elif tag == "bool":
        if t is not bool:
            raise _bad(name, x, "bool", xfer)
    elif tag == "str":
        if t is not str or len(x) > MAX_REASON_LEN:
            raise _bad(name, x, f"str of at most {MAX_REASON_LEN} chars", xfer)
    elif tag == "parts":
        if t is not list or not 0 < len(x) <= MAX_PARTS:
            raise _bad(name, x, f"list of 1..{MAX_PARTS} parts", xfer)
        for i, p in enumerate(x):
            if type(p) is not dict:
                raise _bad(f"parts[{i}]", p, "map", xfer)
            _check_fields(p, PART_FIELDS, f"part {i}", xfer)
    else:  # pragma: no cover
        raise AssertionError(tag)


def _check_kv(h: dict, payload: memoryview) -> list[int]:
    """Sizes of a ``kv`` message's parts (checked against its fields and payload)."""
    xfer = h["xfer"]
    sizes = []
    for i, p in enumerate(h["parts"]):
        isz = DTYPES[p["dtype"]]
        n = prod(p["shape"]) * isz
        piece_bytes = prod(p["lshape"]) * isz
        if p["offset"] + n > piece_bytes:
            raise WireError("bad_offset",
                            f"part {i}: field 'offset': {p['offset']} + size {n} (shape {p['shape']}) exceeds "
                            f"the piece's {piece_bytes} bytes (lshape={p['lshape']})", xfer)
        sizes.append(n)
    total = sum(sizes)
    if h["nbytes"] != total:
        raise WireError("nbytes_mismatch", f"field 'nbytes': {h['nbytes']} != {total}, the sum of the parts' "
                                           f"sizes (prod(shape) * itemsize(dtype) each)", xfer)
    if payload.nbytes != total:
        raise WireError("nbytes_mismatch",
                        f"field 'nbytes': header says {total} bytes, payload frame has {payload.nbytes}", xfer)
    return sizes
