"""The parts of the transport's security one at a time: key derivation, the encryption setting,
the rejection log, the bound on unauthenticated connections (with real sockets), storage roots."""

from __future__ import annotations

import logging
import socket
import time

import pytest
import zmq

from recps.errors import ConfigError
from recps.ps.node.server import check_storage_path, storage_roots_from_env
from recps.ps.transport import curve_keys, security
from recps.ps.transport.security import (
    EVENT_ACCEPTED,
    EVENT_DISCONNECTED,
    PendingConnections,
    RejectionLog,
    resolve_encryption,
)


def test_curve_keys_are_a_function_of_the_token():
    a, b = curve_keys("token-a"), curve_keys("token-b")
    assert curve_keys(b"token-a") == a and a != b
    assert len({a.server_public, a.server_secret, a.client_public, a.client_secret}) == 4
    assert zmq.curve_public(a.server_secret) == a.server_public  # each public key belongs to its secret
    assert zmq.curve_public(a.client_secret) == a.client_public
    assert "secret" not in repr(a) and a.server_secret.decode() not in repr(a)


def test_curve_keys_need_a_token(monkeypatch):
    monkeypatch.delenv("RECPS_CLUSTER_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="no cluster token"):
        curve_keys(None)


def test_encryption_setting(monkeypatch):
    monkeypatch.delenv(security.ENCRYPTION_ENV, raising=False)
    assert resolve_encryption(None) is True and resolve_encryption(False) is False
    monkeypatch.setenv(security.ENCRYPTION_ENV, "off")
    assert resolve_encryption(None) is False and resolve_encryption(True) is True
    monkeypatch.setenv(security.ENCRYPTION_ENV, "maybe")
    with pytest.raises(ConfigError, match=r"\$RECPS_TRANSPORT_ENCRYPTION='maybe'; use curve \(the default\) or off"):
        resolve_encryption(None)


def test_rejection_log_counts_everything_and_logs_once_per_interval(caplog):
    log = RejectionLog("server X", interval_s=0.3, log=logging.getLogger("test.rejections"))
    caplog.set_level(logging.WARNING, logger="test.rejections")
    for i in range(10_000):
        log.note("malformed" if i % 2 else "token", f"detail {i}")
    assert len(caplog.records) == 1 and "(token: 1); last: detail 0" in caplog.records[0].getMessage()
    log.tick()  # within the interval: nothing
    assert len(caplog.records) == 1
    time.sleep(0.35)
    log.tick()
    assert len(caplog.records) == 2
    assert "rejected 9999 messages or connections" in caplog.records[1].getMessage()
    assert "(malformed: 5000, token: 4999); last: detail 9999" in caplog.records[1].getMessage()
    log.flush()  # nothing held back
    assert len(caplog.records) == 2 and log.counts() == {"token": 5000, "malformed": 5000} and log.total() == 10_000


def test_pending_connections_bound_and_accounting():
    """Fed by hand with the events a listening socket's monitor gives: the limit+1-th connection is
    shut down (a real socket pair: its peer reads EOF), a failure is counted with its disconnection,
    a connection that sent a message is no longer pending, and one past the handshake time expires."""
    log = RejectionLog("server X", interval_s=60.0)
    pending = PendingConnections(limit=2, handshake_timeout_s=0.2, rejections=log)
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        for ours, _ in pairs:
            pending.on_event(EVENT_ACCEPTED, ours.fileno())
        assert len(pending) == 2 and log.counts() == {"unauthenticated_limit": 1}
        pairs[2][1].settimeout(2.0)
        assert pairs[2][1].recv(10) == b""  # shut down: the attacker's side sees the end
        pending.on_event(EVENT_DISCONNECTED, pairs[2][0].fileno())  # its disconnection is not counted twice
        pending.authenticated(pairs[0][0].fileno())
        assert len(pending) == 1
        pending.on_event(int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL), int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC))
        pending.on_event(EVENT_DISCONNECTED, pairs[1][0].fileno())
        assert log.counts() == {"unauthenticated_limit": 1, "handshake": 1}
        pending.on_event(EVENT_DISCONNECTED, pairs[0][0].fileno())  # an authenticated one leaving: no rejection
        assert log.total() == 2 and len(pending) == 0
        pending.on_event(EVENT_ACCEPTED, 1000)
        time.sleep(0.25)
        pending.on_event(EVENT_ACCEPTED, 1001)  # 1000 has outlived the handshake time: it finished its handshake
        assert list(pending.pending) == [1001]
        pending.on_event(EVENT_DISCONNECTED, 1001)
        assert log.counts()["unauthenticated_closed"] == 1
    finally:
        for a, b in pairs:
            a.close()
            b.close()
    with pytest.raises(ValueError, match="max_unauthenticated=0"):
        PendingConnections(0, 1.0, log)


def test_shutdown_leaves_a_socket_of_another_endpoint_alone():
    a, b = socket.socketpair()
    try:
        security._shutdown(a.fileno(), "tcp://127.0.0.1:1")  # a unix socket pair is not that endpoint
        a.sendall(b"still open")
        assert b.recv(20) == b"still open"
    finally:
        a.close()
        b.close()


def test_storage_paths(tmp_path):
    roots = [str(tmp_path / "run"), "hdfs://nn:9000/runs"]
    check_storage_path(str(tmp_path / "run"), roots, "save")
    check_storage_path(f"file://{tmp_path}/run/ckpt/step-3", roots, "save")
    check_storage_path("hdfs://nn:9000/runs/a/ckpt", roots, "load")
    for bad in (str(tmp_path / "running"), str(tmp_path / "run" / ".." / "x"), "/etc/cron.d/x", "hdfs://nn:9000/runs2",
                "hdfs://other:9000/runs/a", "s3://runs/a", "run/ckpt"):
        with pytest.raises(ConfigError, match=r"save: path .* is outside the storage roots"):
            check_storage_path(bad, roots, "save")
    assert storage_roots_from_env({}) is None and storage_roots_from_env({"RECPS_STORAGE_ROOTS": " "}) is None
    assert storage_roots_from_env({"RECPS_STORAGE_ROOTS": "/a, hdfs://nn:9000/b,"}) == ("/a", "hdfs://nn:9000/b")
