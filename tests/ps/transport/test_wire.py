"""The wire format alone: round trips of every dtype and shape, and rejection of malformed frames."""

import struct

import pytest
import torch

from recps.errors import ConfigError
from recps.ps.transport import wire
from recps.ps.transport.wire import REPLY, REQUEST, Status, WireError, decode, encode

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
SHAPES = [(0,), (0, 16), (5,), (3, 4), (), (2, 3, 4), (1000, 64)]


def _sample(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def _copy_frames(frames):
    # What a peer receives: bytes, never the sender's memory.
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype):
    tensors = [_sample(dtype, s, i) for i, s in enumerate(SHAPES)]
    msg = decode(_copy_frames(encode(REQUEST, 42, verb="push", text="emb", tensors=tensors)))
    assert (msg.kind, msg.request_id, msg.verb, msg.text) == (REQUEST, 42, "push", "emb")
    assert len(msg.tensors) == len(tensors)
    for sent, got in zip(tensors, msg.tensors):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)


def test_named_tensors_travel_by_name():
    """A mapping of tensors travels under its names: `fields` gives them by name; unnamed tensors
    (a sequence) are under their position, and `tensors` keeps the order either way."""
    sent = {"keys": torch.arange(3), "rows": torch.ones(3, 2), "héllo": torch.zeros(0)}
    msg = decode(_copy_frames(encode(REQUEST, 1, verb="push", tensors=sent)))
    assert msg.names == ["keys", "rows", "héllo"] and list(msg.fields) == ["keys", "rows", "héllo"]
    for name, t in sent.items():
        assert torch.equal(msg.fields[name], t)
    assert [t.shape for t in msg.tensors] == [(3,), (3, 2), (0,)]
    positional = decode(_copy_frames(encode(REQUEST, 2, tensors=[torch.tensor([5]), torch.tensor([6.0])])))
    assert positional.names == ["", ""] and {k: v.tolist() for k, v in positional.fields.items()} == {0: [5], 1: [6.0]}
    with pytest.raises(ValueError, match="tensor name"):
        encode(REQUEST, 3, tensors={"x" * 256: torch.zeros(1)})


def test_non_contiguous_tensor_travels_by_value():
    t = torch.arange(24, dtype=torch.float32).view(4, 6)[:, ::2]  # (4, 3) strided view
    (got,) = decode(_copy_frames(encode(REQUEST, 1, verb="v", tensors=[t]))).tensors
    assert torch.equal(got, t)


def test_meta_round_trip_keeps_types():
    meta = {"step": -(1 << 62), "lr": 0.125, "sync": True, "off": False, "name": "héllo", "empty": ""}
    got = decode(_copy_frames(encode(REPLY, 3, meta=meta))).meta
    assert got == meta
    assert [type(v) for v in got.values()] == [int, float, bool, bool, str, str]


def test_error_reply_carries_status_and_text():
    msg = decode(_copy_frames(encode(REPLY, 9, status=Status.HANDLER_ERROR, text="KeyError: 7")))
    assert (msg.status, msg.text, msg.tensors) == (Status.HANDLER_ERROR, "KeyError: 7", [])


def test_encode_refuses_what_cannot_travel():
    with pytest.raises(TypeError, match="dtype torch.bool"):
        encode(REQUEST, 1, tensors=[torch.zeros(2, dtype=torch.bool)])
    with pytest.raises(TypeError, match="meta values must be int, float, bool or str"):
        encode(REQUEST, 1, meta={"x": [1, 2]})
    with pytest.raises(ValueError, match="does not fit in int64"):
        encode(REQUEST, 1, meta={"x": 1 << 63})
    with pytest.raises(TypeError, match="send torch.Tensors"):
        encode(REQUEST, 1, tensors=[[1, 2, 3]])


def _good():
    return _copy_frames(encode(REQUEST, 5, verb="pull", text="t", tensors=[torch.arange(4)], meta={"a": 1}))


_KEYS = torch.arange(4).numpy().tobytes()  # the one tensor of _build's messages: (4,) int64
_NO_NAME = b"\x00"  # a descriptor starts with its tensor's name: length u8 (0: unnamed), UTF-8
_DESC = _NO_NAME + struct.pack("<BBQ", wire.DTYPE_CODES[torch.int64], 1, 4)
_META = struct.pack("<HB", 1, 1) + b"aq" + struct.pack("<q", 1)


def _build(verb=b"pull", text=b"t", meta=_META, descs=_DESC, tensors=(_KEYS,), extra=b"", **fixed):
    """A message put together field by field, so that one field at a time can be broken."""
    fields = dict(magic=wire.MAGIC, version=wire.VERSION, kind=REQUEST, status=0, rid=5, digest=bytes(16),
                  n=len(tensors), verb_len=len(verb), text_len=len(text), meta_len=len(meta))
    fields.update(fixed)
    return [wire._FIXED.pack(*fields.values()) + verb + text + meta + descs + extra, *tensors]


def _malformed():
    return {
        "empty message": [],
        "short head": [_build()[0][:10], _KEYS],
        "bad magic": _build(magic=b"XXXX"),
        "other version": _build(version=wire.VERSION + 1),
        "unknown kind": _build(kind=7),
        "unknown status": _build(status=999),
        "tensor count vs frames": _build(n=2),
        "lengths past the head": _build(text_len=1000),
        "text too long": _build(text_len=1 << 20),
        "unknown dtype": _build(descs=_NO_NAME + struct.pack("<BBQ", 99, 1, 4)),
        "too many dims": _build(descs=_NO_NAME + struct.pack("<BB", wire.DTYPE_CODES[torch.int64], 9) + bytes(72)),
        "descriptor cut short": _build(descs=_DESC[:6]),
        "no descriptor": _build(descs=b""),
        "shape vs bytes": _build(descs=_NO_NAME + struct.pack("<BBQ", wire.DTYPE_CODES[torch.int64], 1, 5)),
        "huge dim": _build(descs=_NO_NAME + struct.pack("<BBQQ", wire.DTYPE_CODES[torch.int64], 2, 0, 1 << 63)),
        "name past the head": _build(descs=b"\x40keys" + _DESC[1:]),
        "name not utf-8": _build(descs=b"\x02\xff\xfe" + _DESC[1:]),
        "trailing head": _build(extra=b"\x00"),
        "truncated tensor": _build(tensors=(_KEYS[:-1],)),
        "verb not utf-8": _build(verb=b"\xff\xfe\xfd\xfc"),
        "truncated meta": _build(meta=_META[:-2]),
        "meta trailing": _build(meta=_META + b"\x00"),
        "meta bad type": _build(meta=b"\x01\x00\x01kZ"),
        "meta bad bool": _build(meta=b"\x01\x00\x01k?\x02"),
        "meta key past end": _build(meta=b"\x01\x00\x09k"),
        "meta string past end": _build(meta=b"\x01\x00\x01ks" + struct.pack("<I", 99) + b"ab"),
    }


def test_build_makes_the_same_bytes_as_encode():
    assert _build() == _good()


@pytest.mark.parametrize("case", list(_malformed()))
def test_malformed_messages_raise_wire_error(case):
    assert decode(_good()).tensors[0].tolist() == [0, 1, 2, 3]  # the unmodified message parses
    with pytest.raises(WireError):
        decode(_malformed()[case])


def test_peek_request_id_only_for_this_version():
    good = _good()
    assert wire.peek_request_id(good[0]) == 5
    assert wire.peek_request_id(_build(version=9)[0]) is None
    assert wire.peek_request_id(b"abc") is None


def test_token_from_argument_or_environment(monkeypatch):
    monkeypatch.setenv(wire.TOKEN_ENV, "from-env")
    assert wire.resolve_token(None) == b"from-env"
    assert wire.resolve_token("arg") == b"arg"
    assert wire.token_digest("arg") == wire.token_digest(b"arg") != wire.token_digest("other")
    monkeypatch.delenv(wire.TOKEN_ENV)
    with pytest.raises(ConfigError, match="RECPS_CLUSTER_TOKEN / cluster.token"):
        wire.resolve_token(None)
    with pytest.raises(ConfigError, match="empty"):
        wire.resolve_token("")


def test_large_tensors_travel_in_chunks_of_at_most_max_frame_bytes():
    """No frame exceeds MAX_FRAME_BYTES (what ZMQ_MAXMSGSIZE enforces): a 40 MiB tensor travels
    as 16 + 16 + 8 MiB, a tensor of exactly 16 MiB in one frame, and both come back equal."""
    big = torch.arange(10 * (1 << 20), dtype=torch.float32)  # (10M,) 40 MiB
    exact = torch.ones(1 << 22)  # (4M,) exactly 16 MiB
    frames = encode(REQUEST, 1, verb="push", tensors={"big": big, "exact": exact, "small": torch.arange(3)})
    sizes = [memoryview(f).nbytes for f in frames[1:]]
    assert sizes == [wire.CHUNK_BYTES, wire.CHUNK_BYTES, 8 << 20, 16 << 20, 24]
    assert max(memoryview(f).nbytes for f in frames) <= wire.MAX_FRAME_BYTES
    msg = decode(_copy_frames(frames))
    assert torch.equal(msg.fields["big"], big) and torch.equal(msg.fields["exact"], exact)
    assert msg.fields["small"].tolist() == [0, 1, 2]


def test_chunks_that_do_not_add_up_are_refused():
    big = torch.zeros(5 << 20, dtype=torch.float32)  # (5M,) 20 MiB: chunks of 16 and 4 MiB
    head, first, last = _copy_frames(encode(REQUEST, 1, tensors=[big]))
    with pytest.raises(WireError, match="chunk 1 has 4194303 bytes; chunks are 16777216 bytes, the last 4194304"):
        decode([head, first, last[:-1]])
    with pytest.raises(WireError, match="chunk 0 has 4194304 bytes"):
        decode([head, last, first])
    with pytest.raises(WireError, match=r"1 tensors in 2 frames .* the message has 1 tensor frames"):
        decode([head, first])


def test_a_head_over_max_frame_bytes_is_not_sent():
    meta = {f"k{i}": "x" * wire.MAX_TEXT_BYTES for i in range(wire.MAX_META_ENTRIES)}  # each value allowed alone
    with pytest.raises(ValueError, match="at most 16777216 travel: send large values as tensors"):
        encode(REQUEST, 1, verb="push", text="t" * wire.MAX_TEXT_BYTES, meta=meta)
