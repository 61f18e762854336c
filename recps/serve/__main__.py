"""`python -m recps.serve <stream.out URL | run dir> [--host H] [--port P]`: serve a stream's model over HTTP.

The argument is the stream's `stream.out` (any fsspec URL: hdfs://, a path, ...) or the run folder
of the `python -m recps.train stream=...` run that writes it (its recps-job.yaml names it). The
server waits for the first committed export (GET /healthz answers 503 meanwhile), then follows the
donefiles: docs/serving.md.
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


def stream_out(target: str) -> str:
    """The stream.out to follow: `target` itself, or the one a run folder's recps-job.yaml names."""
    job = Path(target) / JOB_CONFIG
    if "://" in target or not job.is_file():
        return target
    from omegaconf import OmegaConf  # deferred: only for a run folder

    cfg = OmegaConf.load(job)
    out = OmegaConf.select(cfg, "stream.out") if bool(OmegaConf.select(cfg, "stream.enabled", default=False)) else None
    if out is None:
        what = "a funnel run (pipeline=...)" if OmegaConf.select(cfg, "pipeline") is not None else "not a stream run"
        raise ConfigError(f"{target} is {what}: recps.serve follows a stream's exports; give the stream.out of a "
                          "`python -m recps.train stream=...` run, or its run folder (serving a funnel: "
                          "python -m recps.pipeline.recommend)")
    return str(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recps.serve", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="the stream's stream.out (a path or URL), or the run folder of its training")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--poll-seconds", type=float, default=1.0, help="how often the donefiles are read")
    parser.add_argument("--max-candidates", type=int, default=4096, help="candidates a /v1/score request may hold")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait for the model; one more is answered 503")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the model")
    args = parser.parse_args(argv)
    # force: importing the package (torch, fbgemm) may have configured the root logger at WARNING already
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    quiet_libraries()
    for name, value, low in (("--poll-seconds", args.poll_seconds, 0.01), ("--max-candidates", args.max_candidates, 1),
                             ("--max-queue", args.max_queue, 1), ("--threads", args.threads, 1)):
        if value < low:
            print(f"recps.serve: {name}={value}; it must be at least {low}", file=sys.stderr)
            return 2
    try:
        out = stream_out(args.target)
    except RecpsError as exc:
        print(f"recps.serve: {exc}", file=sys.stderr)
        return 2
    import torch  # deferred: the arguments are checked first
    import uvicorn

    from recps.serve.app import ServeSettings, build_app

    torch.set_num_threads(args.threads)
    settings = ServeSettings(out=out, poll_s=args.poll_seconds, max_candidates=args.max_candidates,
                             max_queue=args.max_queue)
    logging.getLogger("recps.serve").info("serve: following %s on http://%s:%d", out, args.host, args.port)
    uvicorn.run(build_app(settings), host=args.host, port=args.port, log_level="info", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
