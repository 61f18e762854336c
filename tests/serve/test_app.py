"""recps.serve.app without a process: the inference queue is bounded (one request more than
--max-queue is answered 503 at once, naming the limit, while the one in flight completes), and a
request's own error is its 422."""

from __future__ import annotations

import asyncio
import threading

from recps.serve.app import ServeSettings, Serving
from recps.serve.model import RequestError


def test_a_full_queue_answers_503_and_the_request_in_flight_completes():
    serving = Serving(ServeSettings(out="memory://recps-serve-test/none", max_queue=1))
    gate = threading.Event()

    def slow(_):
        assert gate.wait(10)
        return {"answered": True}

    def refused(_):
        raise RequestError("unknown feature(s) ['Z']")

    async def scenario():
        first = asyncio.ensure_future(serving._infer(slow, None, RequestError))
        await asyncio.sleep(0.05)  # the first one is on the inference thread now
        assert serving.queued == 1
        overloaded = await serving._infer(slow, None, RequestError)
        gate.set()
        return overloaded, await first, await serving._infer(refused, None, RequestError)

    try:
        overloaded, first, bad = asyncio.run(scenario())
    finally:
        serving.stop()
    assert overloaded[0] == 503 and "overloaded: the queue holds its 1 requests" in overloaded[1]["detail"]
    assert "--max-queue=1" in overloaded[1]["detail"]
    assert first == (200, {"answered": True})
    assert bad == (422, {"detail": "unknown feature(s) ['Z']"})
    assert serving.queued == 0
