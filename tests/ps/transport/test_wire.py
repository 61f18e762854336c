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


def _with_header(frames, header):
    return [header, *frames[1:]]


def _malformed():
    good = _good()
    head = good[0]
    fixed = wire._FIXED.size
    return {
        "too few frames": good[:3],
        "short header": _with_header(good, head[:10]),
        "bad magic": _with_header(good, b"XXXX" + head[4:]),
        "other version": _with_header(good, head[:4] + bytes([wire.VERSION + 1]) + head[5:]),
        "unknown kind": _with_header(good, head[:5] + b"\x07" + head[6:]),
        "unknown status": _with_header(good, head[:6] + struct.pack("<H", 999) + head[8:]),
        "tensor count vs frames": _with_header(good, head[: fixed - 2] + struct.pack("<H", 2) + head[fixed:]),
        "unknown dtype": _with_header(good, head[:fixed] + b"\x63" + head[fixed + 1 :]),
        "too many dims": _with_header(good, head[:fixed] + head[fixed : fixed + 1] + b"\x09" + head[fixed + 2 :]),
        "shape vs bytes": _with_header(good, head[:fixed] + head[fixed : fixed + 2] + struct.pack("<Q", 5)),
        "huge dim": _with_header(good, head[:fixed] + head[fixed : fixed + 2] + struct.pack("<Q", 1 << 63)),
        "trailing header": _with_header(good, head + b"\x00"),
        "truncated tensor": good[:4] + [good[4][:-1]],
        "verb not utf-8": [good[0], b"\xff\xfe", *good[2:]],
        "truncated meta": [*good[:3], good[3][:-2], *good[4:]],
        "meta trailing": [*good[:3], good[3] + b"\x00", *good[4:]],
        "meta bad type": [*good[:3], b"\x01\x00\x01kZ", *good[4:]],
        "meta bad bool": [*good[:3], b"\x01\x00\x01k?\x02", *good[4:]],
        "meta string past end": [*good[:3], b"\x01\x00\x01ks" + struct.pack("<I", 99) + b"ab", *good[4:]],
    }


@pytest.mark.parametrize("case", list(_malformed()))
def test_malformed_messages_raise_wire_error(case):
    assert decode(_good()).tensors[0].tolist() == [0, 1, 2, 3]  # the unmodified message parses
    with pytest.raises(WireError):
        decode(_malformed()[case])


def test_peek_request_id_only_for_this_version():
    good = _good()
    assert wire.peek_request_id(good[0]) == 5
    assert wire.peek_request_id(b"RCPS\x09" + good[0][5:]) is None
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
