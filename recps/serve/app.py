"""The HTTP server: FastAPI routes over one Serving (a Follower of the stream's exports, one Scorer).

    POST /v1/score   {"user": {feature: value}, "candidates": [{feature: value}, ...]}
                     -> {"version": {day, pass, base_key, deltas, committed_unix}, "probs": [...],
                         "unknown_keys": n}
    POST /v1/recommend  {"users": [id, ...]} -> {"lists": [{"user", "items", "scores": {stage: [...]}}]}
                     (a funnel run: FunnelServing, recps.pipeline.recommend's load_funnel and recommend)
    GET  /healthz    200 {"ready": true, "version": {... with its folders}, "refused": ...}
                     503 {"ready": false, "reason": ...} until a version is served
    GET  /metrics    Prometheus text, every name prefixed recps_

Threads. The follower polls the donefiles on its own thread and publishes each version by one
reference assignment (recps.serve.versions). Requests are scored on one inference thread: each
takes the version served when it starts and is answered by it alone, and the model's dense
parameters are switched to a new version only between two requests. At most `max_queue` requests
wait for it; one more is answered 503 at once (bounded memory, never a crash), so a load generator
sees overload as it is. The event loop only parses, validates and queues.

Errors: malformed JSON 400; an unknown field, a value of the wrong type, an unknown feature or user
422; more candidates than `max_candidates` (users than `max_users`) 413; the route of the other kind
of run 404; not ready or overloaded 503. Each names what was wrong.

A funnel run (`pipeline=...`) is served as `python -m recps.pipeline.recommend` serves it: its exports
are loaded once (they do not follow a stream yet) and `recommend` answers on the inference thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from recps.errors import ConfigError
from recps.serve.model import RequestError, Scorer
from recps.serve.versions import Follower, Version

__all__ = ["ServeSettings", "Serving", "FunnelServing", "build_app"]

log = logging.getLogger("recps.serve")

# One feature's raw value: a number, a string, null, or a list of them (a sequence feature).
_Scalar = Union[StrictInt, StrictFloat, StrictStr, None]
_Value = Union[_Scalar, list[Union[StrictInt, StrictStr]]]

_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ScoreRequest(BaseModel):
    """A user's features and the candidates to score (each candidate's own features)."""

    model_config = ConfigDict(extra="forbid")

    user: dict[str, _Value] = Field(default_factory=dict)
    candidates: list[dict[str, _Value]] = Field(min_length=1)


class RecommendRequest(BaseModel):
    """Users (ids of the funnel run's data) to recommend to."""

    model_config = ConfigDict(extra="forbid")

    users: list[StrictInt] = Field(min_length=1)


@dataclass(frozen=True)
class ServeSettings:
    """`out`: the stream's output (any recps.fs URL), or the run folder of a funnel run (`funnel`);
    `poll_s`: how often the donefiles are read; `max_candidates`, `max_users`: per request;
    `max_queue`: requests waiting for the inference thread."""

    out: str
    funnel: bool = False
    poll_s: float = 1.0
    max_candidates: int = 4096
    max_users: int = 256
    max_queue: int = 64


class _Base:
    """What both kinds of serving share: the metrics registry, the request counts, one inference
    thread with a bounded queue, and a background thread (`_background`) started and stopped with the app."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("recps_requests", "HTTP requests answered, by route and status code",
                                ["route", "code"], registry=self.registry)
        self.latency = Histogram("recps_request_seconds", "time from a request's arrival to its answer, by route",
                                 ["route"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queued = 0  # requests submitted to the inference thread and not answered yet
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recps-serve-infer")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _background(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self._background, name="recps-serve-follow", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _infer(self, fn, request, refused: type[Exception]) -> tuple[int, dict[str, Any]]:
        """fn(request) on the inference thread: (200, its body); 503 when `max_queue` requests wait
        already; 422 for a `refused` error (what the request got wrong)."""
        with self._lock:
            if self.queued >= self.settings.max_queue:
                return 503, {"detail": f"overloaded: the queue holds its {self.queued} requests (recps.serve "
                                       f"--max-queue={self.settings.max_queue}); retry later"}
            self.queued += 1
        try:
            return 200, await asyncio.wrap_future(self._pool.submit(fn, request))
        except refused as e:
            return 422, {"detail": str(e)}
        finally:
            with self._lock:
                self.queued -= 1

    def _queued_metric(self):
        queued = GaugeMetricFamily("recps_queued_requests", "requests waiting for the inference thread")
        queued.add_metric([], float(self.queued))
        return queued


class Serving(_Base):
    """A stream's model: the follower, the scorer and the request bookkeeping behind the routes."""

    def __init__(self, settings: ServeSettings) -> None:
        super().__init__(settings)
        self.scorer: Scorer | None = None
        self.follower = Follower(settings.out, accept=self._accept)
        self.candidates = Counter("recps_scored_candidates", "candidates scored", registry=self.registry)
        self.unknown = Counter("recps_unknown_keys", "keys of scored requests the served version does not hold "
                               "(served as zero rows)", registry=self.registry)
        self.registry.register(_FollowerCollector(self))

    # -- following -----------------------------------------------------------------------------------

    def _accept(self, version: Version) -> None:
        if self.scorer is None:
            self.scorer = Scorer(version.config_yaml)  # the first version builds the model
        self.scorer.check(version)

    def _background(self) -> None:
        while not self._stop.is_set():
            try:
                self.follower.poll()
            except Exception:  # noqa: BLE001 - the thread outlives any one poll; the log has the cause
                log.exception("serve: polling %s failed; trying again", self.settings.out)
            self._stop.wait(self.settings.poll_s)

    # -- scoring -------------------------------------------------------------------------------------

    def _score(self, request: ScoreRequest) -> dict[str, Any]:
        """On the inference thread: one version from start to end."""
        version = self.follower.current
        examples = self.scorer.encode(request.user, request.candidates)
        probs, unknown = self.scorer.score(version, examples)
        self.candidates.inc(len(request.candidates))
        self.unknown.inc(unknown)
        return {"version": version.describe(), "probs": probs.tolist(), "unknown_keys": unknown}

    async def score(self, request: ScoreRequest) -> tuple[int, dict[str, Any]]:
        if self.follower.current is None:
            return 503, {"detail": f"not ready: {self.follower.waiting}"}
        if len(request.candidates) > self.settings.max_candidates:
            return 413, {"detail": f"{len(request.candidates)} candidates; at most {self.settings.max_candidates} "
                                   "a request (recps.serve --max-candidates): split the list"}
        return await self._infer(self._score, request, RequestError)

    def health(self) -> tuple[int, dict[str, Any]]:
        f = self.follower
        refused = None
        if f.refusal is not None:
            refused = {"folder": f.refusal.folder, "error": f.refusal.error, "attempts": f.refusal.attempts}
        if f.current is None:
            return 503, {"ready": False, "reason": f.waiting if not refused else f"{f.waiting}; {refused['error']}",
                         "refused": refused}
        return 200, {"ready": True, "version": f.current.describe(folders=True), "refused": refused}


class FunnelServing(_Base):
    """A funnel run (`pipeline=...`): its exports loaded once, `recommend` on the inference thread."""

    def __init__(self, settings: ServeSettings) -> None:
        super().__init__(settings)
        self.funnel = None
        self._lists = None  # recps.pipeline.recommend.recommend, once the funnel's code is imported
        self.error = ""  # why the funnel could not be loaded
        self.users = Counter("recps_recommended_users", "users recommended to", registry=self.registry)
        self.registry.register(_FunnelCollector(self))

    def _background(self) -> None:
        from recps.pipeline.recommend import load_funnel, recommend  # deferred: the funnel's code (faiss, its data)

        self._lists = recommend

        t = time.perf_counter()
        try:
            self.funnel = load_funnel(self.settings.out)
        except Exception as e:  # noqa: BLE001 - not ready, and /healthz says why
            self.error = f"{type(e).__name__}: {e}"
            log.error("serve: cannot load the funnel of %s: %s", self.settings.out, self.error)
            return
        log.info("serve: serving the funnel of %s (stages %s, loaded in %.1f s)", self.settings.out,
                 [spec.name for spec in self.funnel.specs], time.perf_counter() - t)

    def _recommend(self, request: RecommendRequest) -> dict[str, Any]:
        lists = self._lists(self.funnel, request.users)
        self.users.inc(len(lists))
        return {"run": self.settings.out, "lists": lists}

    async def recommend(self, request: RecommendRequest) -> tuple[int, dict[str, Any]]:
        if self.funnel is None:
            return 503, {"detail": f"not ready: {self.error or 'the funnel is being loaded'}"}
        if len(request.users) > self.settings.max_users:
            return 413, {"detail": f"{len(request.users)} users; at most {self.settings.max_users} a request "
                                   "(recps.serve --max-users): split the list"}
        return await self._infer(self._recommend, request, ConfigError)  # recommend's: an unknown user

    def health(self) -> tuple[int, dict[str, Any]]:
        if self.funnel is None:
            return 503, {"ready": False, "reason": self.error or "the funnel is being loaded"}
        return 200, {"ready": True, "run": self.settings.out, "stages": [spec.name for spec in self.funnel.specs]}


class _FunnelCollector:
    def __init__(self, serving: FunnelServing) -> None:
        self.serving = serving

    def collect(self):
        ready = GaugeMetricFamily("recps_ready", "1 once the funnel is loaded")
        ready.add_metric([], 1.0 if self.serving.funnel is not None else 0.0)
        yield ready
        yield self.serving._queued_metric()


class _FollowerCollector:
    """The served version and the follower's counts, read at each scrape."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    def collect(self):
        s = self.serving
        f = s.follower
        v = f.current
        ready = GaugeMetricFamily("recps_ready", "1 once a version is served")
        ready.add_metric([], 1.0 if v is not None else 0.0)
        yield ready
        if v is not None:
            for name, doc, value in (
                    ("recps_served_day", "the day (YYYYMMDD) of the pass the served version was saved after", int(v.day)),
                    ("recps_served_pass", "the pass (of its day) the served version was saved after", v.pass_id),
                    ("recps_served_base_key", "the base key (the records') of the served version", v.base_key),
                    ("recps_served_deltas", "deltas applied on the served version's base", len(v.deltas)),
                    ("recps_served_committed_timestamp_seconds", "when the served version's last export was committed "
                     "(unix time)", v.committed_unix),
                    ("recps_served_staleness_seconds", "seconds since the served version's last export was committed",
                     max(0.0, time.time() - v.committed_unix))):
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], float(value))
                yield g
            rows = GaugeMetricFamily("recps_served_rows", "rows of each sparse table in the served version", labels=["table"])
            for table, n in v.rows().items():
                rows.add_metric([table], float(n))
            yield rows
        bases = CounterMetricFamily("recps_bases_loaded", "bases loaded and served")
        bases.add_metric([], float(f.counts.bases_loaded))
        yield bases
        applied = CounterMetricFamily("recps_deltas_applied", "deltas applied and served, each once")
        applied.add_metric([], float(f.counts.deltas_applied))
        yield applied
        refused = CounterMetricFamily("recps_refused", "refusals of an export (a checksum, a missing file, another "
                                      "model), by kind; each retry that fails counts again", labels=["kind"])
        for kind, n in f.counts.refused.items():
            refused.add_metric([kind], float(n))
        yield refused
        waiting = GaugeMetricFamily("recps_refused_pending", "1 while the next export is refused and the previous "
                                    "version is kept")
        waiting.add_metric([], 1.0 if f.refusal is not None else 0.0)
        yield waiting
        yield s._queued_metric()


def _message(errors: list[dict]) -> tuple[int, str]:
    """(status, one line) of FastAPI's validation errors: malformed JSON 400, the rest 422."""
    if any(e.get("type") == "json_invalid" for e in errors):
        e = next(e for e in errors if e.get("type") == "json_invalid")
        where = e.get("ctx", {}).get("error", "")
        return 400, f"the body is not valid JSON ({where})"
    parts = []
    for e in errors[:10]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if tuple(e.get("loc", ())) == ("body",) and e.get("type") == "model_attributes_type":
            parts.append("the body must be a JSON object {\"user\": {...}, \"candidates\": [...]} sent as "
                         "Content-Type: application/json")
        elif e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {loc!r} (/v1/score takes 'user' and 'candidates', /v1/recommend 'users')")
        else:
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return 422, "; ".join(parts)


class _Stamp:
    """Pure ASGI middleware: a request's arrival time in request.state.started (the latency histogram's
    start), without Starlette's @app.middleware("http"), which runs every request in a task of its own
    and streams its response."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["started"] = time.perf_counter()
        await self.app(scope, receive, send)


def build_app(settings: ServeSettings) -> FastAPI:
    """The ASGI app of `settings` (uvicorn runs it: recps.serve.__main__)."""
    serving: Serving | FunnelServing = FunnelServing(settings) if settings.funnel else Serving(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.start()
        try:
            yield
        finally:
            serving.stop()

    app = FastAPI(title="recps.serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving

    def answer(route: str, started: float, code: int, body: dict) -> JSONResponse:
        serving.requests.labels(route, str(code)).inc()
        serving.latency.labels(route).observe(time.perf_counter() - started)
        return JSONResponse(body, status_code=code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        code, message = _message(list(exc.errors()))
        return answer(request.url.path, request.state.started if hasattr(request.state, "started")
                      else time.perf_counter(), code, {"detail": message})

    app.add_middleware(_Stamp)

    @app.post("/v1/score")
    async def score(request: Request, body: ScoreRequest) -> JSONResponse:
        if not isinstance(serving, Serving):
            return answer("/v1/score", request.state.started, 404, {
                "detail": f"{settings.out} is a funnel run: POST /v1/recommend {{\"users\": [...]}}"})
        code, out = await serving.score(body)
        return answer("/v1/score", request.state.started, code, out)

    @app.post("/v1/recommend")
    async def recommend(request: Request, body: RecommendRequest) -> JSONResponse:
        if not isinstance(serving, FunnelServing):
            return answer("/v1/recommend", request.state.started, 404, {
                "detail": f"{settings.out} is a stream's model: POST /v1/score (a funnel run's folder serves "
                          "/v1/recommend)"})
        code, out = await serving.recommend(body)
        return answer("/v1/recommend", request.state.started, code, out)

    @app.get("/healthz")
    async def healthz(request: Request) -> JSONResponse:
        code, out = serving.health()
        return answer("/healthz", request.state.started, code, out)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(serving.registry), media_type=CONTENT_TYPE_LATEST)

    return app
