"""Following a stream's published exports: the newest committed base, then each later delta of that base.

    follower = Follower(out, accept=scorer.check)
    follower.poll()          # reads the donefiles once; makes and publishes every version it can
    follower.current         # the Version served now (None: nothing committed yet), immutable

What a version is. The stream job (recps.stream) publishes under `out` a base a day (mode 2, the
serving export at the day's end, `<day+1>/base/`, a record in base_donefile.txt) and a delta every
few passes (mode 1, `<day>/delta-<pass>/`, a record in patch_donefile.txt) carrying the base key it
continues. A version is the newest base with the first n deltas of its key applied in record order
(before the stream's first base: the first day's deltas applied to empty tables), each applied once.
Sparse rows: a delta's rows overwrite or add, then its deleted keys go (as SparseTable.load applies a
delta); the dense parameters are the last export's (every export holds them whole).

Exactly once, in order, never in part. A folder is read with read_ps_checkpoint, which checks every
file against the export's manifest (size and sha256) as it reads it; the new version is built beside
the served one (copy on write: new tensors, the served ones are never written) and replaces it by one
reference assignment, so a request that took `current` is answered by that version alone. A folder
that fails (a checksum, a missing file, a manifest not yet written, a model that is not the served
one) is refused: nothing of it is applied, the version before it goes on being served, the refusal
is logged and counted, and the folder is tried again after a back-off (1 s doubling to 60 s); the
deltas after it wait for it. A newer base starts a new chain; while it is refused the served chain
goes on. A restarted follower reads the records anew and comes back at the newest version they name
(if the newest base is refused, at the newest earlier base that loads, with its deltas).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from recps import fs as rfs
from recps.errors import ConfigError, RecpsError
from recps.job.checkpoint import MANIFEST, SparseRows, read_ps_checkpoint, read_recorded
from recps.stream.donefile import Donefiles

__all__ = ["Version", "Follower", "Refusal", "apply_delta"]

log = logging.getLogger("recps.serve")

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
# A test hook: the delta folder (as its record names it) whose application stops in the middle, its
# files read and its version not made, until HOLD_MAX_S pass (tests/serve: a SIGKILL lands there).
HOLD_ENV = "RECPS_SERVE_HOLD_DELTA"
HOLD_MAX_S = 300.0


@dataclass(frozen=True)
class Version:
    """One servable model, never changed once made.

    `base`: the base folder (None: deltas before the stream's first base); `base_key`: its key (the
    records'); `deltas`: the delta folders applied on it, in order; `day`, `pass_id`: the pass its last
    export was saved after (its manifest's); `committed_unix`: when that export was committed;
    `sparse`: PS table -> rows; `dense`: the dense table's parameters by name; `config_yaml`: the
    export's config.yaml (the model it was trained as)."""

    base: str | None
    base_key: int
    deltas: tuple[str, ...]
    day: str
    pass_id: int
    committed_unix: float
    sparse: Mapping[str, SparseRows]
    dense: Mapping[str, torch.Tensor]
    config_yaml: str

    @property
    def name(self) -> str:
        """`<day>/<pass> base <key>+<deltas>`: what the log says."""
        return f"{self.day}/{self.pass_id} base {self.base_key}+{len(self.deltas)}"

    def rows(self) -> dict[str, int]:
        return {table: len(rows) for table, rows in self.sparse.items()}

    def describe(self, folders: bool = False) -> dict:
        """The version as a response names it (`folders`: with the base and delta folders)."""
        out = {"day": self.day, "pass": self.pass_id, "base_key": str(self.base_key), "deltas": len(self.deltas),
               "committed_unix": self.committed_unix}
        if folders:
            out.update(base=self.base, delta_folders=list(self.deltas), rows=self.rows())
        return out


def apply_delta(rows: SparseRows | None, delta: SparseRows) -> SparseRows:
    """New rows: `rows` (None: empty) with the delta's rows written over or added, then its deleted
    keys removed (SparseTable.load's order). Neither input is changed."""
    if rows is None or len(rows) == 0:
        keys, values = delta.keys, delta.values  # (R,), (R, D)
    else:
        kept = ~torch.isin(rows.keys, delta.keys)  # (N,)
        keys = torch.cat([rows.keys[kept], delta.keys])  # (N', )
        values = torch.cat([rows.values[kept], delta.values])  # (N', D)
    if delta.deleted is not None and delta.deleted.numel():
        alive = ~torch.isin(keys, delta.deleted)
        keys, values = keys[alive], values[alive]
    order = torch.argsort(keys)
    return SparseRows(keys[order], values[order])


@dataclass
class Refusal:
    """A folder that could not be applied: why, how often, when it is tried again (time.monotonic)."""

    folder: str
    error: str
    attempts: int = 1
    retry_at: float = 0.0


@dataclass
class _Counts:
    bases_loaded: int = 0
    deltas_applied: int = 0
    refused: dict[str, int] = field(default_factory=lambda: {"base": 0, "delta": 0})  # refusals (attempts), by kind


class Follower:
    """Follows the donefiles under `out` (any recps.fs URL); see the module docstring.

    `accept(version)`: raises RecpsError for a version that cannot be served (e.g. another model);
    the version's folder is then refused like a corrupt one. `poll()` is called from one thread;
    `current`, `refusal`, `waiting` and the counts may be read from any."""

    def __init__(self, out: str, accept: Callable[[Version], None] | None = None) -> None:
        self.out = str(out).rstrip("/")
        self.done = Donefiles(self.out)
        self.accept = accept or (lambda version: None)
        self.current: Version | None = None
        self.refusal: Refusal | None = None  # the folder the served version waits for, if refused
        self.waiting = f"no base or delta is recorded under {self.out} yet"  # why nothing is served, or ""
        self.counts = _Counts()
        self._refusals: dict[str, Refusal] = {}
        self._hold = os.environ.get(HOLD_ENV, "").rstrip("/")

    # -- one poll ----------------------------------------------------------------------------------

    def poll(self) -> Version | None:
        """Reads the donefiles; applies what they add (each version published as it is made).
        Returns the version served after it. A donefile that cannot be read is logged and
        retried at the next poll."""
        try:
            bases, patches = self.done.bases(), self.done.patches()
        except (RecpsError, OSError) as e:
            log.warning("serve: cannot read the donefiles under %s (%s: %s); trying again", self.out,
                        type(e).__name__, e)
            return self.current
        if bases:
            key, base = int(bases[-1]["key"]), self.done.export_folder(bases[-1])
        elif patches:  # the stream's first day: its deltas start from empty tables
            key, base = int(patches[0]["key"]), None
        else:
            return self.current
        start = self.current
        if start is None or (start.base_key, start.base) != (key, base):
            made = self._base(key, base)  # None: refused (or no base: deltas from empty tables)
            if made is not None or base is None:
                start = made
            elif start is not None:  # the newer base is refused: the served chain goes on with what its key adds
                key, base = start.base_key, start.base
            else:  # nothing served yet (a restart): the newest earlier base that loads, and its deltas
                for record in reversed(bases[:-1]):
                    key, base = int(record["key"]), self.done.export_folder(record)
                    start = self._base(key, base)
                    if start is not None:
                        break
                else:
                    return None
        chain = [self.done.export_folder(p) for p in patches if int(p["key"]) == key]
        if start is not None and list(start.deltas) != chain[:len(start.deltas)]:
            log.warning("serve: the patch records of base key %d no longer begin with the %d deltas served (%s); "
                        "starting again from the base", key, len(start.deltas), start.name)
            start = self._base(key, base)
            if start is None and base is not None:
                return self.current
        for folder in chain[len(start.deltas) if start is not None else 0:]:
            prev = start
            start = self._step(folder, "delta", lambda: self._load(folder, prev, key, base))
            if start is None:
                break
        return self.current

    def _base(self, key: int, base: str | None) -> Version | None:
        """The version of base `base` alone (published), or None (refused; or no base)."""
        if base is None:
            return None
        return self._step(base, "base", lambda: self._load(base, None, key, base))

    def _step(self, folder: str, kind: str, make: Callable[[], Version]) -> Version | None:
        """Makes, checks and publishes one version (a base or a delta applied), or refuses `folder`."""
        refused = self._refusals.get(folder)
        if refused is not None and time.monotonic() < refused.retry_at:
            return None
        t = time.perf_counter()
        try:
            version = make()
            self.accept(version)
        except (RecpsError, OSError, ValueError, KeyError) as e:  # a damaged manifest is a ValueError/KeyError
            attempts = refused.attempts + 1 if refused else 1
            delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (attempts - 1))
            message = f"{type(e).__name__}: {e}"
            self._refusals[folder] = self.refusal = Refusal(folder, message, attempts, time.monotonic() + delay)
            self.counts.refused[kind] += 1
            served = self.current.name if self.current else "nothing"
            log.error("serve: %s %s refused (attempt %d): %s; still serving %s; trying it again in %.0f s",
                      kind, folder, attempts, message, served, delay)
            return None
        self._refusals.pop(folder, None)
        if self.refusal is not None and self.refusal.folder == folder:
            self.refusal = None
        if kind == "base":
            self.counts.bases_loaded += 1
            self.refusal = None  # a new chain: what the old one waited for no longer matters
        else:
            self.counts.deltas_applied += 1
        self.current, self.waiting = version, ""
        log.info("serve: serving %s (%s %s applied in %.2f s, committed %.1f s ago; rows %s)", version.name, kind,
                 folder, time.perf_counter() - t, time.time() - version.committed_unix, version.rows())
        return version

    def _load(self, folder: str, prev: Version | None, key: int, base: str | None) -> Version:
        """The version of `folder`: a base (on nothing), or a delta applied on `prev` (None: on empty
        tables); every file is checked against the export's manifest as it is read."""
        tables = read_ps_checkpoint(folder)  # verifies the manifest's sizes and sha256 as it reads
        manifest = json.loads(rfs.read_bytes(rfs.join(folder, MANIFEST)))
        config_yaml = read_recorded(folder, manifest, "config.yaml").decode()  # checked against the manifest
        is_base = folder == base
        if self._hold and folder.rstrip("/") == self._hold and not is_base:
            log.warning("serve: holding delta %s in the middle of its application (%s, a test hook) for at most "
                        "%.0f s", folder, HOLD_ENV, HOLD_MAX_S)
            time.sleep(HOLD_MAX_S)
        on = prev if prev is not None and not is_base else None
        sparse: dict[str, SparseRows] = dict(on.sparse) if on is not None else {}
        dense: dict[str, torch.Tensor] = {}
        for table, value in tables.items():
            if isinstance(value, dict):
                dense = value
            else:
                sparse[table] = value if is_base else apply_delta(sparse.get(table), value)
        if not dense:
            raise ConfigError(f"{folder} holds no dense table (tables {sorted(tables)}): it is not a stream's "
                              "export; serve the stream.out of a `python -m recps.train stream=...` run")
        state = manifest["progress"]["stream"]
        return Version(base=base, base_key=key, deltas=() if is_base else (*(on.deltas if on else ()), folder),
                       day=str(state["day"]), pass_id=int(state["pass"]),
                       committed_unix=float(manifest["created_unix"]), sparse=sparse, dense=dense,
                       config_yaml=config_yaml)
