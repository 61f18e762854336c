"""`python -m recps.serve <stream.out URL | run dir> [--host H] [--port P]`: serve a stream's model over HTTP.

The argument is the stream's `stream.out` (any fsspec URL: hdfs://, a path, ...) or the run folder
of the `python -m recps.train stream=...` run that writes it (its recps-job.yaml names it). The
server waits for the first committed export (GET /healthz answers 503 meanwhile), then follows the
donefiles: docs/serving.md. The run folder of a funnel run (`pipeline=...`) is served through
POST /v1/recommend, as `python -m recps.pipeline.recommend` serves it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from recps import quiet_libraries
from recps.errors import ConfigError, RecpsError

JOB_CONFIG = "recps-job.yaml"  # what recps.cluster writes into a run folder


def what_to_serve(target: str) -> tuple[str, bool]:
    """(what to serve, whether it is a funnel run): `target` itself (a stream.out), the stream.out a
    run folder's recps-job.yaml names, or a funnel run's folder (`pipeline=...`)."""
    job = Path(target) / JOB_CONFIG
    if "://" in target or not job.is_file():
        return target, False
    from omegaconf import OmegaConf  # deferred: only for a run folder

    cfg = OmegaConf.load(job)
    if bool(OmegaConf.select(cfg, "stream.enabled", default=False)):
        return str(OmegaConf.select(cfg, "stream.out")), False
    if str(OmegaConf.select(cfg, "pipeline.name", default="none")) != "none":
        return target, True
    raise ConfigError(f"{target} is the folder of a single-model run trained once: recps.serve follows a stream's "
                      "exports (give the stream.out of a `python -m recps.train stream=...` run, or its run folder) "
                      "or serves a funnel run (pipeline=...); evaluate this one with python -m recps.evaluate")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recps.serve", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="the stream's stream.out (a path or URL), or the run folder of its training")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--poll-seconds", type=float, default=1.0, help="how often the donefiles are read")
    parser.add_argument("--max-candidates", type=int, default=4096, help="candidates a /v1/score request may hold")
    parser.add_argument("--max-users", type=int, default=256, help="users a /v1/recommend request may hold")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait for the model; one more is answered 503")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the model")
    args = parser.parse_args(argv)
    # force: importing the package (torch, fbgemm) may have configured the root logger at WARNING already
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    quiet_libraries()
    for name, value, low in (("--poll-seconds", args.poll_seconds, 0.01), ("--max-candidates", args.max_candidates, 1),
                             ("--max-users", args.max_users, 1), ("--max-queue", args.max_queue, 1),
                             ("--threads", args.threads, 1)):
        if value < low:
            print(f"recps.serve: {name}={value}; it must be at least {low}", file=sys.stderr)
            return 2
    try:
        out, funnel = what_to_serve(args.target)
    except RecpsError as exc:
        print(f"recps.serve: {exc}", file=sys.stderr)
        return 2
    import torch  # deferred: the arguments are checked first
    import uvicorn

    from recps.serve.app import ServeSettings, build_app

    torch.set_num_threads(args.threads)
    settings = ServeSettings(out=out, funnel=funnel, poll_s=args.poll_seconds, max_candidates=args.max_candidates,
                             max_users=args.max_users, max_queue=args.max_queue)
    logging.getLogger("recps.serve").info("serve: %s %s on http://%s:%d", "the funnel run" if funnel else "following",
                                          out, args.host, args.port)
    uvicorn.run(build_app(settings), host=args.host, port=args.port, log_level="info", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
