"""recps: a recommendation model zoo that trains on a parameter-server backend."""

from recps.errors import ConfigError, DataError, RecpsError

__all__ = ["ConfigError", "DataError", "RecpsError"]
__version__ = "0.1.0"
