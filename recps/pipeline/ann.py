"""The recall stage's item index: the k best items per user over the item tower's vectors (faiss).

    index = ItemIndex.build(item_vectors, item_ids, AnnConfig(metric="ip", threads=2))  # (N, d) float32, (N,) int64
    ids, scores = index.search(user_vectors, k=10_000, exclude=Seen(offsets, seen_ids))  # (U, d) -> (U, k), (U, k)
    index.calibrate(held_out_user_vectors, k=10_000, target_recall=0.95)                   # least effort reaching 0.95
    index.save("hdfs://namenode:9000/run/recall/items.ann")                               # atomic, ids + checksum inside
    index = ItemIndex.load("hdfs://namenode:9000/run/recall/items.ann")
    recall_at_k(ids, index.search(user_vectors, 10_000, exclude=..., exact=True)[0])      # share of the exact top-k found

Shape letters: N items in the catalogue, d the vectors' dimension, U users (queries), k results per user,
S already-seen (user, item) pairs.

Kinds (AnnConfig.kind):
    exact   faiss IndexFlatIP / IndexFlatL2: brute force over every item; exact.
    ivf     IndexIVFFlat: k-means splits the items into nlist lists; a query scans the nprobe lists whose
            centroids score best. nprobe=None scans about scan_factor * k items: the funnel's k is large
            (10,000 of 10^6), and what recall needs is many more scanned items than kept ones.
    hnsw    IndexHNSWFlat: a proximity graph (M links per node); the search beam efSearch is raised to the
            fetched k (a beam narrower than k cannot return k items), so for a k of thousands it is slower
            than ivf; it suits small k.
    auto    exact below exact_threshold items, else ivf.

Scores are "higher is better" for every metric: the inner product (ip), the cosine (cosine: vectors are
L2-normalised at build and search), or minus the squared L2 distance (l2). Each row of a result is sorted
best first.

Filtering the items a user has already seen happens here, where production funnels do it: `exclude` is a
CSR list per query row (offsets (U + 1,), ids (S,)). faiss's ID selectors apply one filter to a whole
batch, so the search over-fetches instead: k + the batch's largest seen count per row, then masks the seen
items out (vectorized: (row, item) keys against the sorted seen keys) and keeps each row's first k
survivors. Over-fetching by the seen count guarantees k survivors for exact search; an approximate search
(ivf, hnsw) may still find fewer (its lists or beam held fewer than the fetched count), and those rows
alone are searched again exactly (`fallback_rows` counts them). A row ends short only when the user has
seen all but fewer than k of the catalogue: its tail is id MISSING (-1) with score -inf.

faiss's OpenMP threads are bounded per call by AnnConfig.threads (faiss.omp_set_num_threads around each
build and search, restored after), so an index in a training or serving process takes no more cores than
it is given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

import faiss
import numpy as np

from recps import fs as rfs
from recps.errors import ConfigError, DataError

__all__ = ["AnnConfig", "ItemIndex", "Seen", "recall_at_k", "MISSING", "METRICS", "KINDS"]

log = logging.getLogger(__name__)

METRICS = ("ip", "cosine", "l2")
KINDS = ("auto", "exact", "ivf", "hnsw")
MISSING = -1  # the id of a padded result slot (its score is -inf); never a valid item id

_MAGIC = b"RECPSANN"
_FORMAT = 1
# Rows searched per faiss call: bounds the (rows, fetched k) id and distance buffers to ~200 MB.
_CELLS_PER_CALL = 1 << 24


@dataclass(frozen=True)
class AnnConfig:
    """How an ItemIndex is built and searched; every field is checked at construction.

    metric           ip | cosine | l2 (scores: inner product, cosine, minus squared L2)
    kind             auto | exact | ivf | hnsw (see the module docstring)
    exact_threshold  kind=auto: exact below this many items, ivf from it on
    nlist            ivf: the number of k-means lists; None: about sqrt(N), at most N // 39
    nprobe           ivf: lists scanned per query; None: enough to scan about scan_factor * fetched k items
    scan_factor      ivf with nprobe=None: items scanned per item kept
    M                hnsw: graph links per node
    ef_construction  hnsw: beam width while building
    ef_search        hnsw: beam width while searching (raised to the fetched k)
    threads          faiss OpenMP threads for build and search
    train_points_per_list, train_iters   ivf: k-means sample (points per list) and iterations
    seed             ivf: k-means seed (the lists are a function of the vectors and the seed)
    """

    metric: str = "ip"
    kind: str = "auto"
    exact_threshold: int = 100_000
    nlist: int | None = None
    nprobe: int | None = None
    scan_factor: float = 16.0
    M: int = 32
    ef_construction: int = 40
    ef_search: int = 128
    threads: int = 1
    train_points_per_list: int = 64
    train_iters: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ConfigError(f"AnnConfig.metric={self.metric!r}: not one of {', '.join(METRICS)}; "
                              "use ip for dot-product towers, cosine for normalised ones, l2 for distances")
        if self.kind not in KINDS:
            raise ConfigError(f"AnnConfig.kind={self.kind!r}: not one of {', '.join(KINDS)}; "
                              "auto picks exact below exact_threshold items and ivf above")
        for name in ("exact_threshold", "M", "ef_construction", "ef_search", "threads", "train_points_per_list",
                     "train_iters"):
            _positive_int(getattr(self, name), f"AnnConfig.{name}")
        for name in ("nlist", "nprobe"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), f"AnnConfig.{name}", "or None for the automatic choice")
        if not (isinstance(self.scan_factor, (int, float)) and math.isfinite(self.scan_factor)
                and self.scan_factor >= 1):
            raise ConfigError(f"AnnConfig.scan_factor={self.scan_factor!r}: must be a number >= 1 "
                              "(items scanned per item kept; 16 gives recall >= 0.95 on clustered vectors)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"AnnConfig.seed={self.seed!r}: must be an integer")


class Seen(NamedTuple):
    """Items to exclude per query row, as CSR: row u's items are ids[offsets[u]:offsets[u + 1]].

    offsets (U + 1,) int64, nondecreasing from 0 to S; ids (S,) int64 item ids. Ids that are not in the
    catalogue are ignored (they cannot be returned anyway); duplicates are harmless."""

    offsets: np.ndarray
    ids: np.ndarray

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence[int]]) -> Seen:
        """From one list of item ids per query row (a convenience for small inputs and tests).

        >>> Seen.from_lists([[3, 5], [], [7]])
        Seen(offsets=array([0, 2, 2, 3]), ids=array([3, 5, 7]))
        """
        lengths = np.fromiter((len(items) for items in lists), dtype=np.int64, count=len(lists))
        offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
        ids = np.fromiter((i for items in lists for i in items), dtype=np.int64, count=int(offsets[-1]))
        return cls(offsets, ids)


class ItemIndex:
    """An item catalogue's vectors in a faiss index, searched for the k best items per query vector.

    Build with `ItemIndex.build`, or `ItemIndex.load` a saved one. `config` may be replaced
    (dataclasses.replace(index.config, threads=2, nprobe=64)) to change the search settings; the build
    settings (metric, kind, nlist, M) are the index's own. Not safe for concurrent `search` calls from
    several threads that change `config` meanwhile; concurrent searches are otherwise faiss's (read-only).

    >>> rng = np.random.default_rng(0)
    >>> index = ItemIndex.build(rng.standard_normal((50, 8), dtype=np.float32), np.arange(100, 150))
    >>> ids, scores = index.search(rng.standard_normal((2, 8), dtype=np.float32), k=3, exclude=Seen.from_lists([[], [101]]))
    >>> ids.shape, scores.shape, bool((ids[1] != 101).all()), bool((np.diff(scores, axis=1) <= 0).all())
    ((2, 3), (2, 3), True, True)
    """

    def __init__(self, index: faiss.Index, ids: np.ndarray, config: AnnConfig, kind: str) -> None:
        self._index = index
        self._ids = ids  # (N,) item id of each faiss position
        self._order = np.argsort(ids, kind="stable")  # (N,) positions by item id
        self._sorted_ids = ids[self._order]  # (N,)
        self.config = config
        self.kind = kind
        self.fallback_rows = 0  # approximate-search rows that found fewer than k and were searched exactly

    # ---- construction -------------------------------------------------------------------------------

    @classmethod
    def build(cls, vectors: Any, ids: Any, config: AnnConfig | None = None) -> ItemIndex:
        """Index `vectors` (N, d) float (float32 kept, other floats converted) under item `ids` (N,) int64."""
        config = config or AnnConfig()
        if not isinstance(config, AnnConfig):
            raise ConfigError(f"ItemIndex.build: config is a {type(config).__name__}; give an AnnConfig(...)")
        x = _vectors(vectors, "item vectors", None)  # (N, d)
        n, d = x.shape
        item_ids = _ids(ids, n)
        if config.metric == "cosine":
            x = _normalised(x, "item vectors", item_ids)
        kind = config.kind if config.kind != "auto" else ("exact" if n < config.exact_threshold else "ivf")
        metric = faiss.METRIC_L2 if config.metric == "l2" else faiss.METRIC_INNER_PRODUCT
        with _omp_threads(config.threads):
            if kind == "exact":
                index = faiss.IndexFlat(d, metric)
            elif kind == "ivf":
                nlist = config.nlist if config.nlist is not None else max(1, min(round(math.sqrt(n)), n // 39))
                if nlist > n:
                    raise ConfigError(f"AnnConfig.nlist={nlist} is more than the {n} items to index; set nlist "
                                      f"<= {max(1, n // 39)} (39 training points per list) or kind=exact")
                quantizer = faiss.IndexFlat(d, metric)
                index = faiss.IndexIVFFlat(quantizer, d, nlist, metric)
                index.cp.niter = config.train_iters
                index.cp.seed = config.seed
                index.cp.max_points_per_centroid = config.train_points_per_list
                index.train(x)
            else:
                index = faiss.IndexHNSWFlat(d, config.M, metric)
                index.hnsw.efConstruction = config.ef_construction
            index.add(x)
        log.info("item index: %s, %d items, d=%d, metric %s", kind, n, d, config.metric)
        return cls(index, item_ids, config, kind)

    @property
    def dim(self) -> int:
        return int(self._index.d)

    @property
    def ids(self) -> np.ndarray:
        """(N,) the item ids, in the index's order (a read-only view)."""
        view = self._ids.view()
        view.flags.writeable = False
        return view

    def __len__(self) -> int:
        return int(self._ids.shape[0])

    def __repr__(self) -> str:
        return f"ItemIndex({self.kind}, {len(self)} items, d={self.dim}, metric={self.config.metric})"

    # ---- search -------------------------------------------------------------------------------------

    def search(self, queries: Any, k: int, exclude: Seen | tuple[Any, Any] | None = None, *,
               exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The k best items for each query row, best first, without each row's excluded items.

        queries (U, d) float; exclude: Seen(offsets (U + 1,), ids (S,)) or None; exact=True searches every
        item (the reference for recall_at_k). Returns (ids (U, k) int64, scores (U, k) float32); a row is
        padded with MISSING / -inf only when fewer than k of the catalogue's items are left after its
        exclusions."""
        n = len(self)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ConfigError(f"k={k!r}: must be a positive integer (the candidates kept per user)")
        k = int(k)
        if k > n:
            raise ConfigError(f"k={k} is larger than the catalogue ({n} items in the index); keep at most {n}")
        q = _vectors(queries, "query vectors", self.dim, allow_empty=True)  # (U, d)
        if self.config.metric == "cosine":
            q = _normalised(q, "query vectors", None)
        u = q.shape[0]
        seen = self._seen_keys(exclude, u)  # (S',) sorted unique row * N + position
        counts = np.bincount(seen // n, minlength=u) if seen.size else np.zeros(u, np.int64)  # (U,)
        out_ids = np.empty((u, k), np.int64)
        out_scores = np.empty((u, k), np.float32)
        if u == 0:  # a batch with no users (the last of an epoch, an empty shard): nothing to search
            return out_ids, out_scores
        rows = max(1, _CELLS_PER_CALL // min(n, k + int(counts.max())))  # query rows per faiss call
        # faiss splits a search over its query rows: more threads than rows only wait on each other (on a
        # loaded machine a parallel region's idle threads cost a scheduler tick: 0.6 -> 10+ ms per user).
        with _omp_threads(min(self.config.threads, u)):
            for start in range(0, u, rows):
                stop = min(u, start + rows)
                fetch = min(n, k + int(counts[start:stop].max()))  # over-fetch: k survive every row's exclusions
                self._search_rows(q[start:stop], start, k, fetch, seen, exact,
                                  out_ids[start:stop], out_scores[start:stop])
        return out_ids, out_scores

    def _search_rows(self, q: np.ndarray, first_row: int, k: int, fetch: int, seen: np.ndarray, exact: bool,
                     out_ids: np.ndarray, out_scores: np.ndarray) -> None:
        """Search rows first_row.. (q: (R, d)) for `fetch` items each, mask, keep k per row into out_*."""
        approximate = not exact and self.kind != "exact"
        dist, pos = self._faiss_search(q, fetch, exact=not approximate)  # (R, fetch), (R, fetch)
        valid = self._unseen(pos, first_row, seen)  # (R, fetch)
        rank = np.cumsum(valid, axis=1)  # (R, fetch): survivors so far, per row
        short = np.flatnonzero(rank[:, -1] < k)  # rows with fewer than k survivors
        if approximate and short.size:
            self.fallback_rows += int(short.size)
            log.debug("item index: %d of %d rows found fewer than k=%d unseen items; searched exactly",
                      short.size, q.shape[0], k)
            dist[short], pos[short] = self._faiss_search(q[short], fetch, exact=True)
            valid[short] = self._unseen(pos[short], first_row + short, seen)
            rank[short] = np.cumsum(valid[short], axis=1)
        keep = valid & (rank <= k)  # (R, fetch): each row's first k survivors, in score order
        scores = -dist if self.config.metric == "l2" else dist  # higher is better
        if keep.sum() == keep.shape[0] * k:  # every row has k: the common case, no scatter
            picked = pos[keep].reshape(-1, k)  # (R, k)
            out_scores[:] = scores[keep].reshape(-1, k)
        else:
            picked = np.full((q.shape[0], k), MISSING, np.int64)  # (R, k)
            out_scores[:] = -np.inf
            r, c = np.nonzero(keep)
            picked[r, rank[r, c] - 1] = pos[r, c]
            out_scores[r, rank[r, c] - 1] = scores[r, c]
        out_ids[:] = np.where(picked >= 0, self._ids[np.maximum(picked, 0)], MISSING)

    def _faiss_search(self, q: np.ndarray, fetch: int, exact: bool) -> tuple[np.ndarray, np.ndarray]:
        """faiss's (distances (R, fetch), positions (R, fetch)); positions -1 where fewer were found."""
        if self.kind == "exact":
            return self._index.search(q, fetch)
        if self.kind == "ivf":
            nlist = self._index.nlist
            if exact:
                nprobe = nlist  # every list: exact
            elif self.config.nprobe is not None:
                nprobe = min(nlist, self.config.nprobe)
            else:
                nprobe = min(nlist, max(1, math.ceil(self.config.scan_factor * fetch * nlist / len(self))))
            return self._index.search(q, fetch, params=faiss.SearchParametersIVF(nprobe=nprobe))
        if exact:  # hnsw: its storage is a flat index over the same positions
            return faiss.downcast_index(self._index.storage).search(q, fetch)
        params = faiss.SearchParametersHNSW(efSearch=max(self.config.ef_search, fetch))
        return self._index.search(q, fetch, params=params)

    def _unseen(self, pos: np.ndarray, rows: int | np.ndarray, seen: np.ndarray) -> np.ndarray:
        """(R, fetch) bool: a found position (>= 0) that its row has not seen. rows: the first global row
        (consecutive rows) or each row's global index (R,)."""
        found = pos >= 0  # (R, fetch)
        if not seen.size:
            return found
        n = len(self)
        # Prefilter with a bitmap of the items any row has seen (a gather), so that only the few found
        # items someone has seen are looked up by (row, item) key (a binary search each).
        anyone = np.zeros(n, bool)  # (N,)
        anyone[seen % n] = True
        r, c = np.nonzero(found & anyone[np.maximum(pos, 0)])  # (C,), (C,) candidates
        row = (rows + r) if np.ndim(rows) == 0 else np.asarray(rows)[r]  # (C,) global rows
        keys = row * n + pos[r, c]  # (C,)
        hit = seen[np.minimum(np.searchsorted(seen, keys), seen.size - 1)] == keys  # (C,)
        found[r[hit], c[hit]] = False
        return found

    def _seen_keys(self, exclude: Seen | tuple[Any, Any] | None, u: int) -> np.ndarray:
        """(S',) the sorted unique keys row * N + position of the excluded items that are in the catalogue."""
        if exclude is None:
            return np.zeros(0, np.int64)
        if not (isinstance(exclude, tuple) and len(exclude) == 2):
            raise DataError(f"exclude: a {type(exclude).__name__}; give Seen(offsets, ids) (CSR: offsets (U + 1,), "
                            "ids (S,)) or None")
        offsets, seen_ids = (np.asarray(part) for part in exclude)
        for name, part in (("offsets", offsets), ("ids", seen_ids)):
            if part.ndim != 1 or not (np.issubdtype(part.dtype, np.integer) or part.size == 0):
                raise DataError(f"exclude.{name}: shape {part.shape}, dtype {part.dtype}; must be a 1-D integer array")
        if offsets.shape[0] != u + 1:
            raise DataError(f"exclude.offsets: {offsets.shape[0]} entries for {u} query rows; CSR offsets need "
                            f"U + 1 = {u + 1} (row u's items are ids[offsets[u]:offsets[u + 1]])")
        offsets = offsets.astype(np.int64)
        if offsets[0] != 0 or offsets[-1] != seen_ids.shape[0] or (np.diff(offsets) < 0).any():
            raise DataError(f"exclude.offsets: must rise from 0 to len(ids)={seen_ids.shape[0]} without decreasing; "
                            f"got first {offsets[0]}, last {offsets[-1]}; build them with Seen.from_lists or a cumsum")
        seen_ids = seen_ids.astype(np.int64)
        rows = np.repeat(np.arange(u, dtype=np.int64), np.diff(offsets))  # (S,)
        at = np.minimum(np.searchsorted(self._sorted_ids, seen_ids), len(self) - 1)  # (S,)
        known = self._sorted_ids[at] == seen_ids  # (S,)
        return np.unique(rows[known] * len(self) + self._order[at[known]])

    def calibrate(self, queries: Any, k: int, target_recall: float = 0.95,
                  exclude: Seen | tuple[Any, Any] | None = None) -> float:
        """Set the least search effort whose recall@k against exact search on `queries` (held-out users'
        vectors, (U, d)) reaches target_recall; returns the recall reached on them.

        ivf: scan_factor (nprobe=None), tried from 2 upwards by x1.5 until nprobe covers every list;
        hnsw: ef_search, from k upwards by x1.5. How much must be scanned depends on how clustered the
        vectors are (10^6 items, k=10,000: scan_factor 12 gives 0.966 on clustered vectors, 16 only 0.51
        on an isotropic Gaussian), which no size rule can know. exact: nothing to set (1.0)."""
        if not (isinstance(target_recall, (int, float)) and 0 < target_recall <= 1):
            raise ConfigError(f"target_recall={target_recall!r}: must be in (0, 1]")
        if self.kind == "exact":
            return 1.0
        truth = self.search(queries, k, exclude, exact=True)[0]  # (U, k)
        n, fetch = len(self), min(len(self), k)
        if self.kind == "ivf":
            nlist = self._index.nlist
            effort, last = 2.0, n / fetch * 1.5  # past `last`, nprobe = nlist: the scan is exhaustive
            settings = lambda e: {"scan_factor": e, "nprobe": None}  # noqa: E731
        else:
            effort, last = float(fetch), float(n) * 1.5
            settings = lambda e: {"ef_search": int(math.ceil(e))}  # noqa: E731
        while True:
            self.config = dataclasses.replace(self.config, **settings(effort))
            reached = recall_at_k(self.search(queries, k, exclude)[0], truth)
            if reached >= target_recall or effort * 1.5 > last:
                break
            effort *= 1.5
        if self.kind == "ivf":
            log.info("item index: scan_factor %.3g (nprobe %d of %d lists for k=%d): recall@k %.4f on %d queries",
                     effort, min(nlist, math.ceil(effort * fetch * nlist / n)), nlist, k, reached, truth.shape[0])
        else:
            log.info("item index: ef_search %d for k=%d: recall@k %.4f on %d queries", self.config.ef_search, k,
                     reached, truth.shape[0])
        return reached

    # ---- save / load --------------------------------------------------------------------------------

    def save(self, url: str | os.PathLike, *, overwrite: bool = False) -> str:
        """Write the index, its item ids and its config to one file at `url` (a path or fsspec URL), atomically
        (recps.fs.write_atomic: readers see no file or the whole file), with a SHA-256 of the payload that
        `load` checks. An existing file is refused unless overwrite=True. Returns the URL."""
        blob = faiss.serialize_index(self._index)  # (B,) uint8
        ids = np.ascontiguousarray(self._ids, dtype="<i8").view(np.uint8)  # (8N,)
        digest = hashlib.sha256()
        digest.update(ids)
        digest.update(blob)
        header = json.dumps({"format": _FORMAT, "kind": self.kind, "dim": self.dim, "count": len(self),
                             "config": dataclasses.asdict(self.config), "ids_bytes": int(ids.nbytes),
                             "index_bytes": int(blob.nbytes), "sha256": digest.hexdigest(),
                             "faiss": faiss.__version__}, sort_keys=True).encode()
        data = b"".join([_MAGIC, struct.pack("<Q", len(header)), header, ids, blob])
        return rfs.write_atomic(url, data, overwrite=overwrite)

    @classmethod
    def load(cls, url: str | os.PathLike, *, threads: int | None = None) -> ItemIndex:
        """An index written by `save`, checked (format, sizes, SHA-256); threads= replaces the saved config's."""
        url = os.fspath(url)
        data = memoryview(rfs.read_bytes(url))
        if bytes(data[:len(_MAGIC)]) != _MAGIC:
            raise DataError(f"{url}: not a recps item index (starts {bytes(data[:8])!r}, expected {_MAGIC!r}); "
                            "give a file written by ItemIndex.save")
        (length,) = struct.unpack_from("<Q", data, len(_MAGIC))
        body = len(_MAGIC) + 8 + length
        try:
            header = json.loads(bytes(data[len(_MAGIC) + 8:body]))
            sizes = (int(header["ids_bytes"]), int(header["index_bytes"]))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{url}: the item index's header is unreadable ({e}); the file is damaged: save it again") from e
        if header.get("format") != _FORMAT:
            raise DataError(f"{url}: item index format {header.get('format')!r}, this recps reads {_FORMAT}; "
                            "rebuild the index with this version")
        if len(data) != body + sum(sizes):
            raise DataError(f"{url}: {len(data)} bytes, its header says {body + sum(sizes)}; the file is "
                            "truncated or damaged: save it again")
        ids, blob = data[body:body + sizes[0]], data[body + sizes[0]:]
        digest = hashlib.sha256()
        digest.update(ids)
        digest.update(blob)
        if digest.hexdigest() != header["sha256"]:
            raise DataError(f"{url}: checksum mismatch (SHA-256 {digest.hexdigest()[:16]}..., header says "
                            f"{header['sha256'][:16]}...); the file is damaged: save it again")
        config = AnnConfig(**{**header["config"], **({} if threads is None else {"threads": threads})})
        index = faiss.deserialize_index(np.frombuffer(blob, dtype=np.uint8))
        item_ids = np.frombuffer(ids, dtype="<i8").astype(np.int64)
        if index.ntotal != header["count"] or item_ids.shape[0] != header["count"] or index.d != header["dim"]:
            raise DataError(f"{url}: the index holds {index.ntotal} vectors of d={index.d} and {item_ids.shape[0]} "
                            f"ids, its header says {header['count']} of d={header['dim']}; save it again")
        return cls(index, item_ids, config, header["kind"])


def recall_at_k(found: Any, truth: Any) -> float:
    """The mean over rows of |found[u] ∩ truth[u]| / |truth[u]|: the share of the exact top-k an approximate
    search returned. found (U, k1) and truth (U, k) item ids; MISSING slots count for nothing (in truth they
    are not asked for). Rows with no truth are left out of the mean.

    >>> recall_at_k([[1, 2, 3], [4, 5, -1]], [[3, 2, 9], [4, 6, 7]])
    0.5
    """
    found, truth = np.asarray(found), np.asarray(truth)
    if found.ndim != 2 or truth.ndim != 2 or found.shape[0] != truth.shape[0]:
        raise DataError(f"recall_at_k: found {found.shape} and truth {truth.shape}; both must be (U, k) with the "
                        "same U (one row per query)")
    u = truth.shape[0]
    f_rows = np.repeat(np.arange(u, dtype=np.int64), found.shape[1])  # (U * k1,)
    t_rows = np.repeat(np.arange(u, dtype=np.int64), truth.shape[1])  # (U * k,)
    f_ids, t_ids = found.reshape(-1).astype(np.int64), truth.reshape(-1).astype(np.int64)
    f_ok, t_ok = f_ids != MISSING, t_ids != MISSING
    codes, inverse = np.unique(np.concatenate([f_ids[f_ok], t_ids[t_ok]]), return_inverse=True)
    f_keys = f_rows[f_ok] * codes.size + inverse[:f_ok.sum()]  # (row, item) as one int64
    t_keys = t_rows[t_ok] * codes.size + inverse[f_ok.sum():]
    hits = np.isin(t_keys, f_keys)  # (valid truth,)
    asked = np.bincount(t_rows[t_ok], minlength=u)  # (U,)
    if not asked.any():
        raise DataError("recall_at_k: truth holds no item ids (all MISSING); give the exact search's ids")
    got = np.bincount(t_rows[t_ok][hits], minlength=u)  # (U,)
    return float(np.mean(got[asked > 0] / asked[asked > 0]))


# ---- helpers --------------------------------------------------------------------------------------------

def _positive_int(value: Any, where: str, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{where}={value!r}: must be a positive integer{' ' + alternative if alternative else ''}")


def _vectors(value: Any, what: str, dim: int | None, allow_empty: bool = False) -> np.ndarray:
    """`value` as a C-contiguous (n, d) float32 array of finite numbers, n >= 1 unless allow_empty (and
    d == dim if given)."""
    a = np.asarray(value)
    if a.ndim != 2 or (a.shape[0] == 0 and not allow_empty) or a.shape[1] == 0:
        raise DataError(f"{what}: shape {a.shape}; expected a non-empty (n, d) array, one vector per row")
    if not np.issubdtype(a.dtype, np.floating):
        raise DataError(f"{what}: dtype {a.dtype}; expected float vectors (float32); convert with .astype(np.float32)")
    if dim is not None and a.shape[1] != dim:
        raise DataError(f"{what}: dimension {a.shape[1]}, the index holds d={dim} item vectors; query with "
                        f"vectors from the same model (user tower output of size {dim})")
    a = np.ascontiguousarray(a, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(a).all(axis=1))
    if bad.size:
        raise DataError(f"{what}: {bad.size} row(s) hold NaN or inf (first: row {bad[0]}); the model that "
                        "produced them diverged or was not trained: fix it before indexing or searching")
    return a


def _ids(value: Any, n: int) -> np.ndarray:
    """`value` as (n,) unique int64 item ids, none equal to MISSING."""
    ids = np.asarray(value)
    if ids.shape != (n,) or not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"item ids: shape {ids.shape}, dtype {ids.dtype}; expected ({n},) integers, one per vector")
    ids = ids.astype(np.int64)
    if (ids == MISSING).any():
        raise DataError(f"item ids: id {MISSING} is reserved for padded result slots (row "
                        f"{int(np.flatnonzero(ids == MISSING)[0])}); map it to another id")
    sorted_ids = np.sort(ids)
    dup = sorted_ids[1:][sorted_ids[1:] == sorted_ids[:-1]]
    if dup.size:
        raise DataError(f"item ids: {dup.size} duplicate(s) (e.g. {int(dup[0])}); each item must appear once")
    return ids


def _normalised(x: np.ndarray, what: str, ids: np.ndarray | None) -> np.ndarray:
    """x / ||x|| per row (metric=cosine); a zero row has no direction and is refused."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)  # (n, 1)
    zero = np.flatnonzero(norms[:, 0] == 0)
    if zero.size:
        which = f"item {int(ids[zero[0]])}" if ids is not None else f"row {zero[0]}"
        raise DataError(f"{what}: {zero.size} zero vector(s) (first: {which}) under metric=cosine; they have no "
                        "direction: drop them or use metric=ip")
    return x / norms


@contextmanager
def _omp_threads(n: int) -> Iterator[None]:
    """faiss's OpenMP threads set to n for the calling thread, restored after."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)
