"""The wire format: how a request or reply travels as one multipart ZeroMQ message.

    frame 0   head     fixed part (_FIXED), verb, text, meta, then one descriptor per tensor
    frame 1+  tensors  the raw bytes of each tensor, C order, little-endian: one frame per tensor,
                       or ceil(bytes / CHUNK_BYTES) frames of CHUNK_BYTES (the last one shorter)
                       for a tensor larger than CHUNK_BYTES

Fixed part, little-endian, 43 bytes: magic b"RCPS", version u8, kind u8 (1 request, 2 reply,
3 request to run at most once: a server answers a resend of it, same request id, with its first reply),
status u16 (`Status`), request id u64, token digest 16 bytes (zeros in replies), tensor count u16,
verb length u8, text length u32, meta length u32. Then:

    verb    UTF-8 ("pull", "push", ...; empty in replies)
    text    UTF-8: the table name in a request, the error message in an error reply
    meta    a flat dict[str, int | float | bool | str] in a tiny binary encoding (_encode_meta)
    per tensor: name length u8, name (UTF-8, may be empty), dtype code u8, ndim u8, ndim x u64 dims

Tensors travel by name when the sender gives a mapping ({"keys": ..., "grads": ...}): the
receiver reads `Message.fields`, a dict from each name (or, for an unnamed tensor, its position)
to the tensor, so an optional field is absent rather than guessed from a count.

Everything but the tensors shares one frame because every ZeroMQ send, receive and frame release
lets go of the GIL, and each time a busy training thread of the same process may keep it for up
to the interpreter's switch interval (5 ms): a pull is 2 frames each way, not 5.

No frame is ever larger than MAX_FRAME_BYTES (16 MiB): the head is bounded by construction and
large tensors travel in chunks. This is what lets a receiver set ZeroMQ's ZMQ_MAXMSGSIZE to
MAX_FRAME_BYTES whatever the tables' sizes, and so refuse, before any authentication, a peer that
declares a larger frame (recps.ps.transport.security). A tensor up to 16 MiB (a pull of 64k keys x
64 fp32) arrives without a copy; a larger one is copied once out of its chunks.

Nothing received is unpickled or evaluated. `decode` checks the magic, the version, the frame count,
every length, every dtype code and that each tensor frame holds exactly numel x itemsize bytes;
anything else raises `WireError`. Tensor frames become tensors without a copy
(np.frombuffer -> torch.from_numpy) when the frame's address suits the dtype's alignment;
small frames, which ZeroMQ stores unaligned inside the message struct, are copied.

Sending is zero-copy too (frames of 64 KiB and more): a tensor passed to `encode` must not be
modified until the message has left, i.e. until the reply to the request has arrived.

Only little-endian hosts are supported (x86-64, aarch64), as the tensor bytes travel as they lie in memory.

>>> import torch
>>> frames = encode(REQUEST, 7, verb="pull", text="emb", tensors={"keys": torch.arange(3)}, meta={"step": 2},
...                 token_digest=token_digest("secret"))
>>> msg = decode(frames)
>>> (msg.kind, msg.request_id, msg.verb, msg.text, msg.meta, msg.fields["keys"].tolist())
(1, 7, 'pull', 'emb', {'step': 2}, [0, 1, 2])
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Mapping, Sequence

import numpy as np
import torch
import zmq

from recps.errors import ConfigError, PSError

__all__ = [
    "PING",
    "MAGIC",
    "VERSION",
    "REQUEST",
    "REQUEST_ONCE",
    "REQUESTS",
    "RESEND_WINDOW_S",
    "REPLY",
    "Status",
    "WireError",
    "Message",
    "DTYPE_CODES",
    "MetaValue",
    "encode",
    "decode",
    "peek_request_id",
    "recv",
    "token_digest",
    "resolve_token",
    "TOKEN_ENV",
    "CHUNK_BYTES",
    "MAX_FRAME_BYTES",
]

MAGIC = b"RCPS"
VERSION = 3  # 2: tensors carry names; 3: tensors over CHUNK_BYTES travel in chunks
REQUEST = 1  # a request a server may run again when the client resends it (reads)
PING = "__ping__"  # a verb the server's transport answers itself; verbs starting with "__" are reserved
REPLY = 2
REQUEST_ONCE = 3  # a request a server runs at most once: a resend (same request id) gets the first reply
REQUESTS = (REQUEST, REQUEST_ONCE)
# A client resends a request whose connection dropped at most this long after it first sent it; a
# server remembers a REQUEST_ONCE (and keeps its reply) twice as long.
RESEND_WINDOW_S = 60.0
TOKEN_ENV = "RECPS_CLUSTER_TOKEN"

# magic, version, kind, status, request id, token digest, n tensors, verb, text and meta lengths
_FIXED = struct.Struct("<4sBBHQ16sHBII")
_DIM = struct.Struct("<Q")
_NO_TOKEN = bytes(16)

# Bounds on what a peer may declare, so that a malformed header cannot make us allocate or loop much.
# Tensor frames at least this large are sent without a copy (pyzmq's default threshold). Below it a
# memcpy is cheaper than a zero-copy frame, which wakes pyzmq's garbage-collector thread (and so
# asks for the GIL) once ZeroMQ is done with it.
ZERO_COPY_BYTES = 1 << 16

CHUNK_BYTES = 1 << 24  # a tensor larger than this travels as several frames of this size
MAX_FRAME_BYTES = CHUNK_BYTES  # no frame of a message is larger (the head included): ZMQ_MAXMSGSIZE
MAX_TENSORS = 256
MAX_NDIM = 8
MAX_DIM = 1 << 48
MAX_TEXT_BYTES = 1 << 16
MAX_META_ENTRIES = 256
_MAX_META_BYTES = MAX_META_ENTRIES * (2 + 255 + 5 + MAX_TEXT_BYTES)

MetaValue = int | float | bool | str


class Status(IntEnum):
    """Status of a reply. Requests carry OK."""

    OK = 0
    HANDLER_ERROR = 1  # the server's handler raised; text holds "<Type>: <message>"
    BAD_MESSAGE = 2  # the request did not parse; text says why
    TOKEN_MISMATCH = 3  # the request's token digest differs from the server's
    VERSION_MISMATCH = 4  # the request speaks another protocol version


class WireError(PSError):
    """A message does not follow the wire format (sent by a foreign or broken peer).

    `status` is what a server answers it with: VERSION_MISMATCH or BAD_MESSAGE.
    """

    def __init__(self, message: str, status: "Status" = None) -> None:
        super().__init__(message)
        self.status = Status.BAD_MESSAGE if status is None else status


# code -> (torch dtype, numpy dtype the bytes are read as); bfloat16 travels as int16 bits.
_DTYPES: dict[int, tuple[torch.dtype, np.dtype]] = {
    1: (torch.float32, np.dtype("<f4")),
    2: (torch.float16, np.dtype("<f2")),
    3: (torch.bfloat16, np.dtype("<i2")),
    4: (torch.float64, np.dtype("<f8")),
    5: (torch.int64, np.dtype("<i8")),
    6: (torch.int32, np.dtype("<i4")),
    7: (torch.int16, np.dtype("<i2")),
    8: (torch.int8, np.dtype("i1")),
    9: (torch.uint8, np.dtype("u1")),
}
_STATUS_OF = {int(s): s for s in Status}
_STATUSES = frozenset(_STATUS_OF)
DTYPE_CODES: dict[torch.dtype, int] = {tdt: code for code, (tdt, _) in _DTYPES.items()}


@dataclass
class Message:
    """A decoded request or reply. `tensors` may share memory with the received ZeroMQ frames."""

    kind: int
    request_id: int
    status: Status = Status.OK
    verb: str = ""
    text: str = ""
    meta: dict[str, MetaValue] = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)
    token_digest: bytes = _NO_TOKEN
    names: list[str] = field(default_factory=list)  # per tensor; "" for an unnamed one

    @property
    def fields(self) -> dict:
        """name -> tensor, an unnamed tensor under its position (int)."""
        names = self.names or [""] * len(self.tensors)
        return {(n if n else i): t for i, (n, t) in enumerate(zip(names, self.tensors))}


def resolve_token(token: str | bytes | None) -> bytes:
    """The cluster token as bytes: `token` if given, else $RECPS_CLUSTER_TOKEN; never empty.

    >>> resolve_token("abc")
    b'abc'
    """
    source = "the token argument"
    if token is None:
        token, source = os.environ.get(TOKEN_ENV), f"${TOKEN_ENV}"
    if isinstance(token, str):
        token = token.encode("utf-8")
    if not token:
        raise ConfigError(
            f"no cluster token ({source} is empty or unset); set the same {TOKEN_ENV} / "
            "cluster.token on every server and worker"
        )
    return bytes(token)


def token_digest(token: str | bytes | None) -> bytes:
    """A 16-byte digest of the cluster token; requests carry it instead of the token itself."""
    return hashlib.blake2b(resolve_token(token), digest_size=16, person=b"recps-cluster").digest()


def _encode_meta(meta: Mapping[str, MetaValue] | None) -> bytes:
    """count u16; per entry: key length u8, key, type char, value (q int64, d float64, ? bool, s u32 length + UTF-8)."""
    if not meta:
        return b"\x00\x00"
    if len(meta) > MAX_META_ENTRIES:
        raise ValueError(f"meta has {len(meta)} entries; at most {MAX_META_ENTRIES} travel")
    out = [struct.pack("<H", len(meta))]
    for key, value in meta.items():
        if not isinstance(key, str):
            raise TypeError(f"meta key {key!r} is a {type(key).__name__}; keys must be str")
        kb = key.encode("utf-8")
        if len(kb) > 255:
            raise ValueError(f"meta key {key[:40]!r}... is {len(kb)} bytes; at most 255")
        out.append(struct.pack("<B", len(kb)) + kb)
        if isinstance(value, bool):
            out.append(b"?" + struct.pack("<B", value))
        elif isinstance(value, (int, np.integer)):
            if not -(1 << 63) <= int(value) < (1 << 63):
                raise ValueError(f"meta[{key!r}]={value} does not fit in int64")
            out.append(b"q" + struct.pack("<q", int(value)))
        elif isinstance(value, (float, np.floating)):
            out.append(b"d" + struct.pack("<d", float(value)))
        elif isinstance(value, str):
            vb = value.encode("utf-8")
            if len(vb) > MAX_TEXT_BYTES:
                raise ValueError(f"meta[{key!r}] is {len(vb)} bytes of text; at most {MAX_TEXT_BYTES}")
            out.append(b"s" + struct.pack("<I", len(vb)) + vb)
        else:
            raise TypeError(
                f"meta[{key!r}] is a {type(value).__name__}; meta values must be int, float, bool or str "
                "(send arrays as tensors)"
            )
    return b"".join(out)


def _decode_meta(buf: memoryview) -> dict[str, MetaValue]:
    n = len(buf)
    if n < 2:
        raise WireError(f"meta frame has {n} bytes; at least 2 expected")
    (count,) = struct.unpack_from("<H", buf, 0)
    if count > MAX_META_ENTRIES:
        raise WireError(f"meta declares {count} entries; at most {MAX_META_ENTRIES}")
    meta: dict[str, MetaValue] = {}
    pos = 2
    try:
        for _ in range(count):
            (klen,) = struct.unpack_from("<B", buf, pos)
            if pos + 1 + klen > n:
                raise WireError(f"meta key declares {klen} bytes past the frame's end")
            key = bytes(buf[pos + 1 : pos + 1 + klen]).decode("utf-8")
            pos += 1 + klen
            kind = bytes(buf[pos : pos + 1])
            pos += 1
            if kind == b"q":
                (meta[key],) = struct.unpack_from("<q", buf, pos)
                pos += 8
            elif kind == b"d":
                (meta[key],) = struct.unpack_from("<d", buf, pos)
                pos += 8
            elif kind == b"?":
                (flag,) = struct.unpack_from("<B", buf, pos)
                if flag > 1:
                    raise WireError(f"meta[{key!r}] bool byte is {flag}; 0 or 1 expected")
                meta[key] = bool(flag)
                pos += 1
            elif kind == b"s":
                (vlen,) = struct.unpack_from("<I", buf, pos)
                if pos + 4 + vlen > n:
                    raise WireError(f"meta[{key!r}] declares {vlen} bytes of text past the frame's end")
                meta[key] = bytes(buf[pos + 4 : pos + 4 + vlen]).decode("utf-8")
                pos += 4 + vlen
            else:
                raise WireError(f"meta[{key!r}] has unknown type code {kind!r}")
    except struct.error as e:
        raise WireError(f"meta frame is truncated ({n} bytes): {e}") from None
    except UnicodeDecodeError as e:
        raise WireError(f"meta text is not UTF-8: {e}") from None
    if pos != n:
        raise WireError(f"meta frame has {n - pos} trailing bytes")
    return meta


def _tensor_buffer(i: int, t: torch.Tensor, name: str = "") -> tuple[bytes, object]:
    """(descriptor, buffer) of one tensor; the buffer shares the tensor's memory when it is contiguous."""
    name_b = name.encode("utf-8")
    if len(name_b) > 255:
        raise ValueError(f"tensor name {name[:40]!r}... is {len(name_b)} bytes; at most 255")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor {i} is a {type(t).__name__}; send torch.Tensors (meta holds scalars)")
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise TypeError(f"tensor {i} has dtype {t.dtype}; the transport carries {supported}")
    if t.device.type != "cpu":
        raise ValueError(f"tensor {i} is on {t.device}; move it to the CPU before sending")
    if t.dim() > MAX_NDIM:
        raise ValueError(f"tensor {i} has {t.dim()} dims; at most {MAX_NDIM} travel")
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()  # the one copy the sender makes: strided views travel by value
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # numpy has no bfloat16; the bits travel as int16
    desc = struct.pack("<B", len(name_b)) + name_b + struct.pack(f"<BB{t.dim()}Q", code, t.dim(), *t.shape)
    return desc, t.numpy().reshape(-1)  # (numel,) shares the tensor's memory; sent through the buffer protocol


def encode(
    kind: int,
    request_id: int,
    *,
    verb: str = "",
    text: str = "",
    tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] = (),
    meta: Mapping[str, MetaValue] | None = None,
    status: Status = Status.OK,
    token_digest: bytes = _NO_TOKEN,
) -> list:
    """The frames of one message (bytes and memoryviews, ready for send_multipart(copy=False)).
    `tensors` as a mapping travel under their names."""
    if isinstance(tensors, Mapping):
        names, tensors = [str(n) for n in tensors], list(tensors.values())
    else:
        names = [""] * len(tensors)
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"{len(tensors)} tensors in one message; at most {MAX_TENSORS}")
    verb_b, text_b = verb.encode("utf-8"), text.encode("utf-8")
    if len(text_b) > MAX_TEXT_BYTES or len(verb_b) > 255:
        raise ValueError(f"verb {verb[:40]!r} or text {text[:40]!r} too long (255 / {MAX_TEXT_BYTES} bytes)")
    descs, bufs = [], []
    for i, (t, name) in enumerate(zip(tensors, names)):
        desc, buf = _tensor_buffer(i, t, name)
        descs.append(desc)
        if buf.nbytes <= CHUNK_BYTES:
            bufs.append(buf)
        else:  # slices of the tensor's memory, sent without a copy
            flat = memoryview(buf).cast("B")
            bufs.extend(flat[pos : pos + CHUNK_BYTES] for pos in range(0, len(flat), CHUNK_BYTES))
    meta_b = _encode_meta(meta)
    fixed = _FIXED.pack(MAGIC, VERSION, kind, int(status), request_id, token_digest, len(descs), len(verb_b), len(text_b), len(meta_b))
    head = b"".join((fixed, verb_b, text_b, meta_b, *descs))
    if len(head) > MAX_FRAME_BYTES:
        raise ValueError(
            f"the header of {verb or 'a reply'!r} is {len(head)} bytes (mostly meta: {len(meta_b)} bytes); at most "
            f"{MAX_FRAME_BYTES} travel: send large values as tensors"
        )
    return [head, *bufs]


def recv(sock, flags: int = 0, envelope: int = 0) -> list:
    """One message from a ZeroMQ socket: the first `envelope` + 1 frames (a ROUTER's identity, the
    head) as bytes, the tensor frames as zmq.Frames (no copy). Copying the small frames saves a
    GIL release per frame (a zmq.Frame lets go of the GIL when it is freed)."""
    more = int(zmq.RCVMORE)
    frames = [sock.recv(flags, copy=True)]
    while len(frames) <= envelope and sock.get(more):
        frames.append(sock.recv(flags, copy=True))
    while sock.get(more):
        frames.append(sock.recv(flags, copy=False))
    return frames


def peek_request_id(frame0) -> int | None:
    """The request id of a header frame from a peer that speaks this version, else None."""
    buf = _buffer(frame0)
    if len(buf) < _FIXED.size:
        return None
    magic, version, _kind, _status, rid, *_ = _FIXED.unpack_from(buf, 0)
    return rid if magic == MAGIC and version == VERSION else None


def _buffer(frame) -> memoryview:
    # zmq.Frame (recv copy=False) exposes .buffer; bytes/bytearray/memoryview also accepted (tests, copy=True).
    buf = getattr(frame, "buffer", frame)
    buf = buf if isinstance(buf, memoryview) else memoryview(buf)
    return buf if buf.format == "B" else buf.cast("B")


def _text(buf: memoryview, what: str) -> str:
    if len(buf) > MAX_TEXT_BYTES:
        raise WireError(f"{what} frame has {len(buf)} bytes; at most {MAX_TEXT_BYTES}")
    try:
        return str(buf, "utf-8")
    except UnicodeDecodeError as e:
        raise WireError(f"{what} is not UTF-8: {e}") from None


def _num_chunks(nbytes: int) -> int:
    """Frames a tensor of `nbytes` travels in (an empty tensor still has its one, empty, frame)."""
    return max(1, -(-nbytes // CHUNK_BYTES))


def _tensor_from_frames(i: int, code: int, shape: tuple[int, ...], frames: Sequence) -> torch.Tensor:
    """The tensor of descriptor `i` from its frames (one, or its chunks), after checking every length."""
    tdt, ndt = _DTYPES[code]
    expected = math.prod(shape) * ndt.itemsize
    bufs = [_buffer(f) for f in frames]
    if len(bufs) == 1:
        if len(bufs[0]) != expected:
            raise WireError(f"tensor {i} of shape {list(shape)} and dtype {tdt} needs {expected} bytes; frame has {len(bufs[0])}")
        arr = np.frombuffer(bufs[0], dtype=ndt)  # (numel,) shares the frame's memory
        if not (arr.flags.aligned and arr.flags.writeable):
            arr = arr.copy()  # small frames live unaligned inside the zmq message; copying them is cheap
    else:
        # Every length is checked before the one allocation, which is then no larger than what arrived.
        last = expected - CHUNK_BYTES * (len(bufs) - 1)
        for j, b in enumerate(bufs):
            if len(b) != (CHUNK_BYTES if j < len(bufs) - 1 else last):
                raise WireError(f"tensor {i} of shape {list(shape)} and dtype {tdt} ({expected} bytes): chunk {j} has "
                                f"{len(b)} bytes; chunks are {CHUNK_BYTES} bytes, the last {last}")
        arr = np.empty(expected // ndt.itemsize, dtype=ndt)  # (numel,)
        raw = arr.view(np.uint8)
        for j, b in enumerate(bufs):
            raw[j * CHUNK_BYTES : j * CHUNK_BYTES + len(b)] = np.frombuffer(b, dtype=np.uint8)
    t = torch.from_numpy(arr.reshape(shape))
    return t.view(torch.bfloat16) if tdt == torch.bfloat16 else t


def decode(frames: Sequence) -> Message:
    """Parse and validate the frames of one message (without a ROUTER identity). Raises WireError."""
    if not frames:
        raise WireError("empty message")
    head = _buffer(frames[0])
    if len(head) < _FIXED.size:
        raise WireError(f"head has {len(head)} bytes; at least {_FIXED.size} expected")
    magic, version, kind, status, rid, digest, n, verb_len, text_len, meta_len = _FIXED.unpack_from(head, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}; expected {MAGIC!r} (not a recps peer)")
    if version != VERSION:
        raise WireError(f"protocol version {version}; this process speaks version {VERSION}", Status.VERSION_MISMATCH)
    if kind not in (REQUEST, REPLY, REQUEST_ONCE):
        raise WireError(f"unknown message kind {kind}")
    if status not in _STATUSES:
        raise WireError(f"unknown status code {status}")
    if len(head) > MAX_FRAME_BYTES:
        raise WireError(f"head has {len(head)} bytes; at most {MAX_FRAME_BYTES}")
    if n > MAX_TENSORS or len(frames) < 1 + n:
        raise WireError(f"head declares {n} tensors; the message has {len(frames) - 1} tensor frames")
    if text_len > MAX_TEXT_BYTES or meta_len > _MAX_META_BYTES:
        raise WireError(f"head declares {text_len} bytes of text and {meta_len} of meta; too many")
    pos = _FIXED.size
    end = pos + verb_len + text_len + meta_len
    if end > len(head):
        raise WireError(f"head of {len(head)} bytes is too short for the {end - pos} bytes of verb, text and meta it declares")
    verb = _text(head[pos : pos + verb_len], "verb")
    text = _text(head[pos + verb_len : pos + verb_len + text_len], "text")
    meta = _decode_meta(head[pos + verb_len + text_len : end])
    shapes, names, pos = [], [], end
    try:
        for i in range(n):
            (name_len,) = struct.unpack_from("<B", head, pos)
            if pos + 1 + name_len > len(head):
                raise WireError(f"tensor {i}'s name declares {name_len} bytes past the head's end")
            names.append(_text(head[pos + 1 : pos + 1 + name_len], f"tensor {i}'s name"))
            pos += 1 + name_len
            code, ndim = struct.unpack_from("<BB", head, pos)
            if ndim > MAX_NDIM:
                raise WireError(f"tensor {i} declares {ndim} dims; at most {MAX_NDIM}")
            shape = struct.unpack_from(f"<{ndim}Q", head, pos + 2)
            if any(d > MAX_DIM for d in shape):
                raise WireError(f"tensor {i} declares shape {list(shape)}; each dim at most {MAX_DIM}")
            if code not in _DTYPES:
                raise WireError(f"tensor {i} has unknown dtype code {code}; known: {sorted(_DTYPES)}")
            shapes.append((code, shape))
            pos += 2 + 8 * ndim
    except struct.error:
        raise WireError(f"head of {len(head)} bytes is too short for {n} tensor descriptors") from None
    if pos != len(head):
        raise WireError(f"head has {len(head) - pos} trailing bytes")
    # Frames per tensor from the declared sizes (Python ints: no overflow); they must add up
    # exactly before any tensor is built.
    counts = [_num_chunks(math.prod(shape) * _DTYPES[code][1].itemsize) for code, shape in shapes]
    if 1 + sum(counts) != len(frames):
        raise WireError(f"head declares {n} tensors in {sum(counts)} frames (chunks of {CHUNK_BYTES} bytes); "
                        f"the message has {len(frames) - 1} tensor frames")
    tensors, first = [], 1
    for i, ((code, shape), count) in enumerate(zip(shapes, counts)):
        tensors.append(_tensor_from_frames(i, code, shape, frames[first : first + count]))
        first += count
    return Message(kind, rid, _STATUS_OF[status], verb, text, meta, tensors, bytes(digest), names)
