"""A stream job's published records: Paddle's three donefiles under `stream.out`, committed atomically.

    <out>/donefile.txt         one line per model: day, base_key, path, pass_id, 0 (tab separated;
                               a pass's checkpoint <out>/<day>/<pass>/, and pass_id -1 for the day
                               model <out>/<day+1>/0/), as Paddle's write_model_donefile
    <out>/base_donefile.txt    one JSON object a line per base <out>/<day+1>/base/
    <out>/patch_donefile.txt   one JSON object a line per delta <out>/<day>/delta-<pass>/
                               (id, key, input, record_count, monitor_data, ... as Paddle's
                               write_xbox_donefile; a base's id is its key, a patch's id the
                               unix second of its record, raised above the id before it when
                               deltas come faster than one a second: unique and increasing)

A base/patch record's `input` is the committed folder itself, `<fs name><path>` (hdfs://host:port/
model/20261202/delta-3; a plain path for a local disk): the folder that recps.serve and
recps.job.checkpoint.read_ps_checkpoint open. Paddle names `<fs><path>/000`, a part folder its
own saves have and recps' do not; records an earlier recps wrote so are still read as their
folder (`export_folder`), so a stream begun before keeps its history.

Paddle rewrites a donefile by deleting it and uploading the new one: a crash in between loses
its history. Here a record is appended by writing the whole new file beside the old one and
renaming it over (recps.fs.write_atomic: atomic on local disks and HDFS), and only after the
folder it names was committed (its manifest lists the sha256 of every server's shard, written
after every shard was: recps.job.checkpoint.commit_ps_checkpoint). A reader finds the old file or
the new one, never a partial one; a record always names a complete, verified folder.

A donefile line that does not parse is an error naming the file, the line and the fix (the job
refuses to append to, or resume from, a history it cannot read).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from recps import fs as rfs
from recps.errors import ConfigError

__all__ = ["Donefiles", "ModelRecord", "MODEL_DONEFILE", "BASE_DONEFILE", "PATCH_DONEFILE", "DAY_MODEL_PASS"]

MODEL_DONEFILE = "donefile.txt"
BASE_DONEFILE = "base_donefile.txt"
PATCH_DONEFILE = "patch_donefile.txt"
DAY_MODEL_PASS = -1  # donefile.txt's pass_id of a day model (Paddle's)
LEGACY_PART = "/000"  # what records written before named after the folder (Paddle's part folder)


@dataclass(frozen=True)
class ModelRecord:
    """A donefile.txt line."""

    day: str
    base_key: int
    path: str
    pass_id: int

    def line(self) -> str:
        return f"{self.day}\t{self.base_key}\t{self.path}\t{self.pass_id}\t0"


def fs_name(url: str) -> str:
    """The file system part of a URL ("hdfs://host:port"; "" for a local path), as Paddle's hadoop_fs_name."""
    scheme, sep, rest = str(url).partition("://")
    if not sep:
        return ""
    host = rest.split("/", 1)[0]
    return f"{scheme}://{host}"


def url_path(url: str) -> str:
    """The path part of a URL (the whole of a local path)."""
    scheme, sep, rest = str(url).partition("://")
    return "/" + rest.split("/", 1)[1] if sep and "/" in rest else (str(url) if not sep else "/")


class Donefiles:
    """The donefiles under a stream job's `out` (any recps.fs URL)."""

    def __init__(self, out: str) -> None:
        self.out = str(out).rstrip("/")

    def url(self, name: str) -> str:
        return rfs.join(self.out, name)

    def _lines(self, name: str) -> list[str]:
        url = self.url(name)
        if not rfs.exists(url):
            return []
        return [line for line in rfs.read_bytes(url).decode("utf-8", errors="replace").splitlines() if line.strip()]

    def _append(self, name: str, line: str) -> None:
        lines = self._lines(name)
        rfs.write_atomic(self.url(name), "".join(f"{x}\n" for x in [*lines, line]), overwrite=True)

    # -- donefile.txt ---------------------------------------------------------------------------

    def models(self) -> list[ModelRecord]:
        """donefile.txt's records, in order; refuses a line that does not parse, naming it."""
        out = []
        for n, line in enumerate(self._lines(MODEL_DONEFILE), start=1):
            parts = line.split("\t")
            try:
                if len(parts) != 5:
                    raise ValueError(f"{len(parts)} fields")
                day, key, path, pass_id = parts[0], int(parts[1]), parts[2], int(parts[3])
                if not (len(day) == 8 and day.isdigit()):
                    raise ValueError(f"day {day!r}")
            except ValueError as e:
                raise ConfigError(f"{self.url(MODEL_DONEFILE)} line {n} does not parse ({e}): {line[:200]!r}; "
                                  "a line is 'day<TAB>base_key<TAB>path<TAB>pass_id<TAB>0': repair or remove the "
                                  "line (the folders it names stay), or give another stream.out") from None
            out.append(ModelRecord(day, key, path, pass_id))
        return out

    def add_model(self, record: ModelRecord) -> None:
        self._append(MODEL_DONEFILE, record.line())

    # -- base_donefile.txt / patch_donefile.txt -------------------------------------------------

    def _json_records(self, name: str) -> list[dict]:
        out = []
        for n, line in enumerate(self._lines(name), start=1):
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or "input" not in record:
                    raise ValueError("not an object with 'input'")
            except ValueError as e:
                raise ConfigError(f"{self.url(name)} line {n} does not parse ({e}): {line[:200]!r}; each line is one "
                                  "JSON object (id, key, input, ...): repair or remove it, or give another "
                                  "stream.out") from None
            out.append(record)
        return out

    def bases(self) -> list[dict]:
        return self._json_records(BASE_DONEFILE)

    def patches(self) -> list[dict]:
        return self._json_records(PATCH_DONEFILE)

    @staticmethod
    def input_of(folder: str) -> str:
        """The `input` a base/patch record names for `folder`: the folder, `<fs name><path>`."""
        return fs_name(folder) + url_path(folder).rstrip("/")

    @staticmethod
    def export_folder(record: dict) -> str:
        """The committed folder a base/patch record names: its `input` (one an earlier recps wrote
        with Paddle's `/000` suffix names the folder holding that part)."""
        folder = str(record["input"]).rstrip("/")
        return folder[: -len(LEGACY_PART)] if folder.endswith(LEGACY_PART) else folder

    def record_of(self, name: str, folder: str) -> dict | None:
        """Base/patch donefile `name`'s record of `folder`, or None."""
        wanted = self.input_of(folder)
        return next((r for r in self._json_records(name) if self.export_folder(r) == wanted), None)

    def published(self, name: str, folder: str) -> bool:
        """Whether base/patch donefile `name` has a record of `folder`."""
        return self.record_of(name, folder) is not None

    def _next_patch_id(self) -> int:
        """A new patch record's id: the unix second, but above every id recorded before (deltas a
        second apart or less would share one: ids are unique and increasing)."""
        ids = [int(r["id"]) for r in self.patches() if str(r.get("id", "")).isdigit()]
        return max([int(time.time()), *(i + 1 for i in ids)])

    def add_export(self, name: str, folder: str, base_key: int, *, rows: int, data_path: str,
                   monitor: dict[str, Any], workers: int) -> dict:
        """Appends the record of the committed export `folder` to `name` (base or patch donefile)."""
        record = {
            "id": str(base_key) if name == BASE_DONEFILE else str(self._next_patch_id()),
            "key": str(base_key),
            "input": self.input_of(folder),
            "record_count": str(int(rows)),
            "partition_type": "2",
            "job_name": "recps",
            "ins_tag": "feasign",
            "ins_path": data_path,
            "monitor_data": monitor,
            "mpi_size": str(workers),
        }
        self._append(name, json.dumps(record, sort_keys=False))
        return record
