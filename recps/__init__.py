"""recps: a recommendation model zoo that trains on a parameter-server backend."""

import logging

from recps.errors import ConfigError, DataError, RecpsError

__all__ = ["ConfigError", "DataError", "RecpsError", "quiet_libraries"]
__version__ = "0.1.0"


class _LibraryNoise(logging.Filter):
    """Drops the log records of libraries under recps that a user cannot act on:
    - fbgemm_gpu's INFO lines, logged on the root logger: "Successfully loaded: '...so'" (14 at import)
      and, per embedding table collection, a ~4 KB dump of its constructor's arguments;
    - torch.fx's "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"
      notice, which torchrec's modules trigger on their first forward pass.
    Warnings and errors of fbgemm_gpu pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING and "fbgemm_gpu" in record.pathname:
            return False
        return not (record.name == "torch.fx._symbolic_trace" and "is_fx_tracing" in str(record.msg))


_NOISE = _LibraryNoise()


def quiet_libraries() -> None:
    """Silences the libraries' log lines a user cannot act on (see `_LibraryNoise`); idempotent.

    The entry points call it (`recps.train` and the servers and workers it starts); a script of
    your own that configures logging at INFO may call it too. It adds filters to the root logger
    and to torch.fx's logger (what they log directly) and sets fbgemm_gpu's own loggers to WARNING;
    no handler changes, nor the level of any logger but fbgemm_gpu's.
    """
    for name in ("", "torch.fx._symbolic_trace"):
        logger = logging.getLogger(name)
        if _NOISE not in logger.filters:
            logger.addFilter(_NOISE)
    logging.getLogger("fbgemm_gpu").setLevel(logging.WARNING)
