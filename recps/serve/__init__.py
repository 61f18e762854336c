"""Serving that follows training: `python -m recps.serve <stream.out URL | run dir> [--host H] [--port P]`.

An HTTP server (FastAPI on uvicorn) that serves the model a stream job (`recps.train stream=...`)
publishes: it loads the newest committed base, applies every later delta of that base in order,
exactly once, each after checking it against its manifest, and swaps each version in whole
(recps.serve.versions); it scores candidates with the zoo model the stream trained
(recps.serve.model); routes, metrics and back-pressure are recps.serve.app's. docs/serving.md
has the layout it reads and the HTTP interface.
"""

from recps.serve.app import ServeSettings, Serving, build_app
from recps.serve.model import RequestError, Scorer
from recps.serve.versions import Follower, Version, apply_delta

__all__ = ["ServeSettings", "Serving", "build_app", "Scorer", "RequestError", "Follower", "Version", "apply_delta"]
