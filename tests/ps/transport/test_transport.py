"""Server and client over real sockets on 127.0.0.1 (free ports), each test bounded in time."""

import threading
import time
from concurrent.futures import Future

import pytest
import torch
import zmq

from recps.errors import PSError, PSTimeoutError
from recps.ps.transport import PING, Status, TransportClient, TransportServer, curve_keys, security, wait_all, wire

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-token"
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]


def echo(verb, table, fields, meta):
    """`fields`: the request's tensors by name, unnamed ones under their position; a dict
    returned sends its values in order."""
    return fields, dict(meta, verb=verb, table=table)


@pytest.fixture
def servers():
    started = []

    def start(handler=echo, **kw):
        kw.setdefault("token", TOKEN)
        server = TransportServer(handler, **kw).start()
        started.append(server)
        return server

    yield start
    for server in started:
        assert server.stop(timeout=5.0)


@pytest.fixture
def clients():
    made = []

    def make(endpoints, token=TOKEN, timeout_s=10.0, **kw):
        client = TransportClient(endpoints, token=token, timeout_s=timeout_s, **kw)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.mark.parametrize("num_threads", [0, 2])
def test_round_trip_every_dtype_and_shape(servers, clients, num_threads):
    server = servers(num_threads=num_threads)
    client = clients([server.endpoint])
    assert server.endpoint.startswith("tcp://127.0.0.1:")
    for dtype in DTYPES:
        tensors = [torch.arange(n, dtype=torch.float64).to(dtype).view(shape) for n, shape in
                   [(0, (0,)), (0, (0, 16)), (1, ()), (6, (2, 3)), (120, (2, 3, 4, 5)), (4099, (4099,))]]
        reply = client.call(0, "echo", "emb", tensors, {"dtype": str(dtype)})
        assert reply.meta == {"dtype": str(dtype), "verb": "echo", "table": "emb"}
        assert [t.dtype for t in reply.tensors] == [dtype] * len(tensors)
        for sent, got in zip(tensors, reply.tensors):
            assert got.shape == sent.shape and torch.equal(got, sent)


@pytest.mark.parametrize("num_threads", [0, 2])
def test_named_fields_reach_the_handler_by_name(servers, clients, num_threads):
    """A request's tensors given as a mapping arrive by name (an optional one is simply absent);
    positional ones under their position; a handler's dict is sent as its values, in order."""
    seen = []

    def handler(verb, table, fields, meta):
        seen.append({k: v.tolist() for k, v in fields.items()})
        if "keys" in fields:
            return {"rows": fields["keys"] * 2, "count": torch.tensor([len(fields)])}
        return [fields[1], fields[0]]

    client = clients([servers(handler, num_threads=num_threads).endpoint])
    reply = client.call(0, "push", "emb", {"keys": torch.arange(3), "shows": torch.ones(3)})
    assert seen[-1] == {"keys": [0, 1, 2], "shows": [1.0, 1.0, 1.0]}
    assert [t.tolist() for t in reply.tensors] == [[0, 2, 4], [2]]
    reply = client.call(0, "push", "emb", {"keys": torch.tensor([5])})  # no shows: absent, not guessed
    assert seen[-1] == {"keys": [5]} and reply.tensors[1].tolist() == [1]
    reply = client.call(0, "pull", "emb", [torch.tensor([7]), torch.tensor([8.0])])
    assert seen[-1] == {0: [7], 1: [8.0]}
    assert [t.tolist() for t in reply.tensors] == [[8.0], [7]]


def test_large_pull_64k_by_64(servers, clients):
    table = torch.randn(70_000, 64)  # (N, D) the server's rows

    def pull(verb, table_name, fields, meta):
        return [table.index_select(0, fields[0])]  # (K, D)

    client = clients([servers(pull).endpoint])
    keys = torch.randperm(70_000)[:65_536]  # (K,)
    (rows,) = client.call(0, "pull", "emb", [keys]).tensors
    assert rows.shape == (65_536, 64) and torch.equal(rows, table[keys])
    rows += 1  # reply tensors are writable (they share the received message's memory)


@pytest.mark.parametrize("curve", [True, False], ids=["curve", "plaintext"])
def test_tensors_over_max_frame_bytes_cross_both_ways(servers, clients, curve):
    """40 MiB out and back: chunked under ZMQ_MAXMSGSIZE on both sides, equal on arrival."""
    big = torch.randn(10 * (1 << 20))  # (10M,) 40 MiB
    server = servers(lambda verb, table, fields, meta: [fields["x"] * 2], curve=curve)
    (doubled,) = clients([server.endpoint], curve=curve).call(0, "push", "t", {"x": big}, timeout=60.0).tensors
    assert torch.equal(doubled, big * 2)
    assert server.rejections == {}


def test_concurrent_threads_fan_out_to_two_servers(servers, clients):
    def scale(verb, table, fields, meta):
        time.sleep(0.002)  # let requests overlap on the handler threads
        return [fields[0] * meta["factor"]], {"server": meta["server"]}

    ends = [servers(scale, num_threads=4).endpoint for _ in range(2)]
    client = clients(ends)
    errors = []

    def train_thread(tid):
        try:
            for step in range(30):
                keys = torch.arange(100) + 1000 * tid + step  # (K,)
                handles = [client.request(s, "pull", "emb", [keys], {"factor": s + 2, "server": s}) for s in range(2)]
                for s, reply in enumerate(wait_all(handles, timeout=10.0)):
                    assert reply.meta == {"server": s}
                    assert torch.equal(reply.tensors[0], keys * (s + 2))
        except Exception as e:  # noqa: BLE001 - surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=train_thread, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_requests_are_served_concurrently(servers, clients):
    # 4 requests of 0.3 s each on 4 handler threads finish in about 0.3 s, not 1.2 s.
    server = servers(lambda *a: time.sleep(0.3), num_threads=4)
    client = clients([server.endpoint])
    start = time.monotonic()
    wait_all([client.request(0, "slow") for _ in range(4)], timeout=5.0)
    assert time.monotonic() - start < 0.9


def test_threads_that_end_hand_their_sockets_on(servers, clients):
    client = clients([servers().endpoint])

    def one_call(i):
        assert client.call(0, "echo", "t", [torch.tensor([i])]).tensors[0].item() == i

    for i in range(5):
        t = threading.Thread(target=one_call, args=(i,))
        t.start()
        t.join(10)
    one_call(5)  # each new thread inherits the sockets of the one that ended
    assert len(client._channels) == 1


def test_handle_waited_from_another_thread(servers, clients):
    client = clients([servers().endpoint])
    made = []
    t = threading.Thread(target=lambda: made.append(client.request(0, "echo", "t", [torch.arange(5)])))
    t.start()
    t.join(10)
    assert torch.equal(made[0].wait(5.0).tensors[0], torch.arange(5))


@pytest.mark.parametrize("num_threads", [0, 2])
def test_handler_error_becomes_client_exception(servers, clients, num_threads):
    def failing(verb, table, fields, meta):
        raise KeyError(f"no table {table!r}")

    server = servers(failing, num_threads=num_threads)
    client = clients([server.endpoint])
    with pytest.raises(PSError, match=r"failed pull on table 'missing' \(3 keys\): KeyError: \"no table 'missing'\"") as e:
        client.call(0, "pull", "missing", [torch.arange(3)])
    assert server.endpoint in str(e.value) and not isinstance(e.value, PSTimeoutError)
    assert client.ping(0, timeout=5.0) > 0  # the server still serves


def test_bad_handler_result_becomes_client_exception(servers, clients):
    client = clients([servers(lambda *a: torch.zeros(2)).endpoint])
    with pytest.raises(PSError, match="returned a Tensor; return a list"):
        client.call(0, "pull", "t")


@pytest.mark.parametrize("num_threads", [0, 1])
def test_deferred_reply_releases_the_handler_thread(servers, clients, num_threads):
    # A 2-party barrier on one thread: the first arrival must not block the thread.
    lock, waiting = threading.Lock(), []

    def barrier(verb, table, fields, meta):
        future = Future()
        with lock:
            waiting.append(future)
            if len(waiting) == 2:
                for f in waiting:
                    f.set_result([torch.tensor([len(waiting)])])
        return future

    client = clients([servers(barrier, num_threads=num_threads).endpoint])
    first = client.request(0, "barrier")
    assert not first.done()
    second = client.request(0, "barrier")
    assert [r.tensors[0].item() for r in wait_all([first, second], timeout=5.0)] == [2, 2]


def test_wrong_token_is_refused(servers, clients):
    """Another token means other CURVE keys: the server cannot open the client's handshake, and the
    client fails its requests after HANDSHAKE_ATTEMPTS refusals (0.1 s apart), not at its timeout."""
    server = servers()
    client = clients([server.endpoint], token="other-token")
    for call in (lambda: client.call(0, "pull", "emb", [torch.arange(2)]), lambda: client.ping(0, timeout=5.0)):
        start = time.monotonic()
        with pytest.raises(PSError) as e:
            call()
        assert not isinstance(e.value, PSTimeoutError)
        assert time.monotonic() - start < 3.0
        assert f"server {server.endpoint} refused the secure handshake" in str(e.value)
        assert "set the same RECPS_CLUSTER_TOKEN / cluster.token (and RECPS_TRANSPORT_ENCRYPTION) on every process" in str(e.value)
    # Each refusal is counted by the server: 3 before the first error, at least 1 more (the client
    # remembers the refusals in a row) before the second.
    deadline = time.monotonic() + 5.0
    while server.rejections.get("handshake", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.rejections["handshake"] >= 4 and set(server.rejections) == {"handshake"}


def test_token_digest_is_still_checked_without_encryption(servers, clients):
    """curve=False (a trusted network): the digest in the header is the only check, as before."""
    server = servers(curve=False)
    assert not server.encrypted
    client = clients([server.endpoint], token="other-token", curve=False)
    with pytest.raises(PSError, match="token mismatch; set the same RECPS_CLUSTER_TOKEN / cluster.token on every process"):
        client.call(0, "pull", "emb", [torch.arange(2)])
    assert server.rejections == {"token": 1}
    assert clients([server.endpoint], curve=False).call(0, "pull", "emb", [torch.arange(2)]).tensors[0].tolist() == [0, 1]


def test_encrypted_client_and_plaintext_server_do_not_talk(servers, clients):
    server = servers(curve=False)
    with pytest.raises(PSError, match="refused the secure handshake .* another encryption setting"):
        clients([server.endpoint]).call(0, "pull", "emb", [torch.arange(2)])


def test_timeout_against_a_server_that_never_answers(clients):
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # receives, never replies
    silent.linger = 0
    security.secure_server_socket(silent, curve_keys(TOKEN))  # it holds the job's keys: the handshake succeeds
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        endpoint = f"tcp://127.0.0.1:{port}"
        client = clients([endpoint])
        start = time.monotonic()
        with pytest.raises(PSTimeoutError) as e:
            client.request(0, "pull", "emb", [torch.arange(8192)]).wait(0.3)
        assert 0.3 <= time.monotonic() - start < 1.5
        assert f"server0 at {endpoint} did not answer pull on table 'emb' (8192 keys) within 0.3 s" in str(e.value)
        with pytest.raises(PSTimeoutError, match=endpoint):
            client.ping(0, timeout=0.2)
    finally:
        silent.close()
        ctx.term()


def test_timeout_against_a_stopped_server_then_late_reply_is_dropped(servers, clients):
    gate = threading.Event()
    slow = servers(lambda verb, *a: gate.wait(5.0) and [torch.tensor([1])] if verb == "slow" else [torch.tensor([2])])
    client = clients([slow.endpoint])
    handle = client.request(0, "slow", "t")
    with pytest.raises(PSTimeoutError):
        handle.wait(0.2)
    gate.set()  # its late reply arrives now and must not be mistaken for the next one
    assert client.call(0, "fast", "t").tensors[0].tolist() == [2]
    with pytest.raises(PSTimeoutError):
        handle.wait(1.0)  # a timed-out request stays failed

    endpoint = slow.endpoint
    assert slow.stop(timeout=5.0)
    start = time.monotonic()
    with pytest.raises(PSTimeoutError, match=endpoint):
        client.call(0, "pull", "t", [torch.arange(3)], timeout=0.3)
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize("num_threads", [0, 2])
def test_malformed_frames_from_a_raw_socket_do_not_kill_the_server(servers, clients, num_threads):
    calls = []
    server = servers(lambda verb, table, fields, meta: calls.append(verb) or [], num_threads=num_threads)
    good = wire.encode(wire.REQUEST, 77, verb="pull", text="t", tensors=[torch.arange(4)], token_digest=wire.token_digest(TOKEN))
    head, keys = bytes(good[0]), bytes(good[1])
    fixed = wire._FIXED.size
    garbage = [
        [b"hello"],
        [b""],
        [b"GET / HTTP/1.1\r\n\r\n"],
        [b"XXXX" + head[4:], keys],
        [head[:4] + bytes([9]) + head[5:], keys],  # another protocol version
        [head, keys[:-3]],  # tensor bytes vs shape
        [head, keys, keys],  # more frames than tensors
        [head + b"\x00", keys],
        [head[:-10] + b"\xff" + head[-9:], keys],  # unknown dtype code
        [head[:fixed - 8] + b"\xff\xff\xff\x00" + head[fixed - 4 :], keys],  # text length past the end
        [bytes(range(256)) * 100] * 7,
    ]
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)  # a peer that holds the token (its CURVE keys) but sends garbage
    raw.linger = 0
    raw.rcvtimeo = 5000
    security.secure_client_socket(raw, curve_keys(TOKEN))
    raw.connect(server.endpoint)
    try:
        for i, frames in enumerate(garbage):
            raw.send_multipart(frames)
            reply = wire.decode(raw.recv_multipart())
            assert reply.status == (Status.VERSION_MISMATCH if i == 4 else Status.BAD_MESSAGE)
            assert reply.text.startswith("malformed request:")
        raw.send_multipart(good)  # a well-formed request on the same socket is served
        assert wire.decode(raw.recv_multipart()).status == Status.OK
    finally:
        raw.close()
        ctx.term()
    assert calls == ["pull"]  # no malformed request reached the handler
    assert server.rejections == {"malformed": len(garbage)}
    assert clients([server.endpoint]).ping(0, timeout=5.0) > 0


def test_ipc_endpoint(servers, clients, tmp_path):
    server = servers(bind=f"ipc://{tmp_path}/s0.sock")
    assert server.endpoint == f"ipc://{tmp_path}/s0.sock"
    reply = clients([server.endpoint]).call(0, "echo", "t", [torch.ones(3, 4)])
    assert torch.equal(reply.tensors[0], torch.ones(3, 4))


def test_fixed_port_and_bind_error(servers):
    server = servers()
    port = int(server.endpoint.rsplit(":", 1)[1])
    with pytest.raises(PSError, match=f"cannot bind server to tcp://127.0.0.1:{port}"):
        TransportServer(echo, token=TOKEN, port=port).start()


def test_stop_is_prompt_with_requests_in_flight(clients):
    server = TransportServer(lambda *a: time.sleep(0.2), token=TOKEN, num_threads=2).start()
    client = clients([server.endpoint])
    handles = [client.request(0, "slow") for _ in range(10)]
    time.sleep(0.05)
    start = time.monotonic()
    assert server.stop(timeout=5.0)
    assert time.monotonic() - start < 2.0
    with pytest.raises(PSTimeoutError):
        wait_all(handles, timeout=0.3)


@pytest.mark.parametrize("num_threads", [0, 2])
def test_stop_called_by_a_handler_does_not_hang(clients, num_threads):
    def shutdown(verb, table, fields, meta):
        server.stop(timeout=5.0)
        return []

    server = TransportServer(shutdown, token=TOKEN, num_threads=num_threads).start()
    client = clients([server.endpoint])
    handle = client.request(0, "shutdown")
    deadline = time.monotonic() + 5.0
    while not server._terminated and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server._terminated  # finished in the background once the handler returned
    assert server.stop(timeout=5.0)
    try:
        assert handle.wait(0.3).tensors == []  # the reply of the request that stopped the server
    except PSTimeoutError:
        pass  # ... may also be lost: the front thread closes the socket with linger=0
    with pytest.raises(PSTimeoutError):
        client.ping(0, timeout=0.3)


def test_client_argument_errors(servers, clients):
    client = clients([servers().endpoint])
    with pytest.raises(ValueError, match="server 3 out of range"):
        client.request(3, "pull")
    with pytest.raises(ValueError, match="reserved"):
        client.request(0, "__mine__")
    with pytest.raises(ValueError, match="no server endpoints"):
        TransportClient([], token=TOKEN)
    assert client.request(0, PING).wait(5.0).tensors == []
    client.close()
    with pytest.raises(PSError, match="closed"):
        client.request(0, "pull")


def test_deferred_error_becomes_client_exception(servers, clients):
    def later(verb, table, fields, meta):
        future = Future()
        threading.Timer(0.05, future.set_exception, [RuntimeError("step 3 missing from worker 1")]).start()
        return future

    client = clients([servers(later).endpoint])
    with pytest.raises(PSError, match=r"failed push on table 'emb' \(2 keys\): RuntimeError: step 3 missing from worker 1"):
        client.call(0, "push", "emb", [torch.zeros(2, 4)], timeout=5.0)
