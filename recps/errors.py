"""Errors a user can cause. Messages name the value, where it came from, and the fix."""

__all__ = ["RecpsError", "ConfigError", "DataError", "PSError", "PSTimeoutError"]


class RecpsError(Exception):
    """Base of every error recps raises on purpose."""


class ConfigError(RecpsError, ValueError):
    """A configuration value is missing, inconsistent or out of range."""


class DataError(RecpsError):
    """Input data is missing, empty, malformed past the error budget, or off-schema."""


class PSError(RecpsError):
    """A parameter-server call failed (refused, peer dead, protocol mismatch)."""


class PSTimeoutError(PSError, TimeoutError):
    """A parameter-server call did not complete within its timeout."""
