"""recps.pipeline.ann: the recall stage's item index against brute force (numpy), approximate kinds against
exact search (recall@k), exclusion of seen items, save/load, and the errors a user can cause."""

import dataclasses

import faiss
import numpy as np
import pytest

from recps.errors import ConfigError, DataError
from recps.pipeline.ann import MISSING, AnnConfig, ItemIndex, Seen, recall_at_k

N, D, U = 20_000, 32, 40


def clustered(rng, n, centers, noise=0.4):
    """(n, d) float32 points around the given centers, as item and user towers produce."""
    return (centers[rng.integers(0, len(centers), n)] + noise * rng.standard_normal((n, centers.shape[1]))).astype(np.float32)


@pytest.fixture(scope="module")
def world():
    rng = np.random.default_rng(7)
    centers = rng.standard_normal((100, D))
    items = clustered(rng, N, centers)  # (N, D)
    ids = rng.permutation(10 * N)[:N].astype(np.int64) + 1_000  # (N,) arbitrary, unordered ids
    users = clustered(rng, U, centers)  # (U, D)
    return items, ids, users


@pytest.fixture(scope="module")
def exact(world):
    items, ids, _ = world
    return ItemIndex.build(items, ids, AnnConfig(kind="exact"))


def brute_force(items, ids, users, k, metric="ip", seen=None):
    """numpy's top-k ids and scores per user (higher is better), without each row's seen ids."""
    if metric == "cosine":
        items = items / np.linalg.norm(items, axis=1, keepdims=True)
        users = users / np.linalg.norm(users, axis=1, keepdims=True)
    if metric == "l2":
        u, x = users.astype(np.float64), items.astype(np.float64)
        scores = -((u ** 2).sum(1)[:, None] - 2 * u @ x.T + (x ** 2).sum(1)[None, :])  # (U, N)
    else:
        scores = users.astype(np.float64) @ items.T.astype(np.float64)  # (U, N)
    if seen is not None:
        scores[_row_mask(seen, len(users), ids)] = -np.inf
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # (U, k)
    return ids[top], np.take_along_axis(scores, top, axis=1)


def _row_mask(seen, u, ids):
    offsets, seen_ids = seen
    mask = np.zeros((u, len(ids)), bool)
    for row in range(u):
        mask[row] = np.isin(ids, seen_ids[offsets[row]:offsets[row + 1]])
    return mask


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_exact_equals_brute_force(world, metric):
    items, ids, users = world
    index = ItemIndex.build(items, ids, AnnConfig(metric=metric, kind="auto"))
    assert index.kind == "exact" and len(index) == N and index.dim == D  # auto: below exact_threshold
    found, scores = index.search(users, 50)
    want_ids, want_scores = brute_force(items, ids, users, 50, metric)
    assert found.dtype == np.int64 and scores.dtype == np.float32 and found.shape == scores.shape == (U, 50)
    assert recall_at_k(found, want_ids) >= 0.999  # float32 vs float64 may swap near-ties at the boundary
    np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-3)
    assert (np.diff(scores, axis=1) <= 0).all()  # best first


@pytest.mark.parametrize("kind, k", [("ivf", 100), ("ivf", 2_000), ("hnsw", 100)])
def test_approximate_recall_against_exact(world, exact, kind, k):
    items, ids, users = world
    index = ItemIndex.build(items, ids, AnnConfig(kind=kind, threads=2))
    assert index.kind == kind
    truth, truth_scores = exact.search(users, k)
    found, scores = index.search(users, k)
    assert recall_at_k(found, truth) >= 0.95
    assert (found != MISSING).all() and (np.diff(scores, axis=1) <= 0).all()
    assert all(len(np.unique(row)) == k for row in found)
    # the approximate index's own exact mode is the reference itself
    np.testing.assert_array_equal(index.search(users, k, exact=True)[1], truth_scores)


def test_auto_switches_to_ivf_above_the_threshold(world, exact):
    items, ids, users = world
    index = ItemIndex.build(items, ids, AnnConfig(exact_threshold=N))
    assert index.kind == "ivf" and index._index.nlist == round(np.sqrt(N))
    assert recall_at_k(index.search(users, 200)[0], exact.search(users, 200)[0]) >= 0.95


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_calibrate_finds_the_effort_for_a_target_recall(kind):
    rng = np.random.default_rng(5)
    items = rng.standard_normal((20_000, D), dtype=np.float32)  # no clusters: the hard case
    held_out, users = rng.standard_normal((30, D), dtype=np.float32), rng.standard_normal((30, D), dtype=np.float32)
    index = ItemIndex.build(items, np.arange(20_000), AnnConfig(kind=kind, scan_factor=1, ef_search=8))
    exact = ItemIndex.build(items, np.arange(20_000), AnnConfig(kind="exact"))
    truth = exact.search(users, 200)[0]
    if kind == "ivf":  # (hnsw's beam is at least k wide whatever ef_search says)
        assert recall_at_k(index.search(users, 200)[0], truth) < 0.9  # too little effort for isotropic vectors
    reached = index.calibrate(held_out, 200, target_recall=0.95)
    assert reached >= 0.95
    assert recall_at_k(index.search(held_out, 200)[0], exact.search(held_out, 200)[0]) == reached
    assert recall_at_k(index.search(users, 200)[0], truth) >= 0.93  # other users of the same distribution
    assert (index.config.scan_factor > 1) if kind == "ivf" else (index.config.ef_search >= 200)
    assert exact.calibrate(held_out, 200) == 1.0
    with pytest.raises(ConfigError, match="target_recall=1.5: must be in"):
        index.calibrate(held_out, 200, target_recall=1.5)


def seen_lists(exact, users, rng):
    """Each user has seen the items the index ranks 0, 2, 4 .. 98 for it, some random ones, unknown ids."""
    top = exact.search(users, 100)[0][:, ::2]  # (U, 50): exclusion must really change the top
    lists = [list(top[u]) + list(rng.choice(exact.ids, 20 + u * 5)) + [-5, 10**12] for u in range(len(users))]
    return Seen.from_lists(lists)


@pytest.mark.parametrize("kind", ["exact", "ivf", "hnsw"])
def test_exclusion_removes_seen_items_and_keeps_k(world, exact, kind):
    items, ids, users = world
    seen = seen_lists(exact, users, np.random.default_rng(1))
    index = exact if kind == "exact" else ItemIndex.build(items, ids, AnnConfig(kind=kind))
    k = 300
    found, scores = index.search(users, k, exclude=seen)
    assert found.shape == (U, k) and (found != MISSING).all() and np.isfinite(scores).all()
    for u in range(U):
        assert not np.isin(found[u], seen.ids[seen.offsets[u]:seen.offsets[u + 1]]).any()
        assert len(np.unique(found[u])) == k
    want, want_scores = brute_force(items, ids, users, k, seen=seen)
    if kind == "exact":
        assert recall_at_k(found, want) >= 0.999
        np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-3)
    else:
        assert recall_at_k(found, want) >= 0.95
    # without the exclusion the seen items do come back: the filter is what removed them
    assert np.isin(index.search(users[:1], k)[0], seen.ids[:seen.offsets[1]]).sum() >= 40


def test_short_approximate_rows_fall_back_to_exact(world, exact):
    items, ids, users = world
    index = ItemIndex.build(items, ids, AnnConfig(kind="ivf", nlist=100, nprobe=1))  # ~200 items per list
    seen = seen_lists(exact, users, np.random.default_rng(2))
    found, scores = index.search(users, 1_000, exclude=seen)
    assert index.fallback_rows == U  # one list cannot hold 1,000 + seen items: every row was searched exactly
    want, _ = brute_force(items, ids, users, 1_000, seen=seen)
    assert (found != MISSING).all() and recall_at_k(found, want) >= 0.999
    assert not any(np.isin(found[u], seen.ids[seen.offsets[u]:seen.offsets[u + 1]]).any() for u in range(U))


def test_an_empty_batch_of_users_returns_empty_results(exact):
    found, scores = exact.search(np.zeros((0, D), np.float32), 7, exclude=Seen.from_lists([]))
    assert found.shape == scores.shape == (0, 7)


def test_a_user_who_has_seen_almost_everything_gets_padding():
    rng = np.random.default_rng(3)
    items, ids = rng.standard_normal((10, 4)).astype(np.float32), np.arange(10) * 3
    index = ItemIndex.build(items, ids)
    found, scores = index.search(rng.standard_normal((2, 4)).astype(np.float32), 5,
                                 exclude=Seen.from_lists([ids[:8], []]))
    assert sorted(found[0, :2]) == [24, 27] and (found[0, 2:] == MISSING).all() and np.isneginf(scores[0, 2:]).all()
    assert (found[1] != MISSING).all()


@pytest.mark.parametrize("kind", ["exact", "ivf", "hnsw"])
def test_save_load_round_trip(world, tmp_path, kind):
    items, ids, users = world
    config = AnnConfig(kind=kind, nprobe=7, threads=2)
    index = ItemIndex.build(items[:5_000], ids[:5_000], config)
    url = index.save(tmp_path / "run" / "items.ann")
    back = ItemIndex.load(url)
    assert back.kind == kind and back.config == config and (back.ids == index.ids).all()
    assert faiss.serialize_index(back._index).tobytes() == faiss.serialize_index(index._index).tobytes()
    for a, b in zip(index.search(users, 64), back.search(users, 64)):
        np.testing.assert_array_equal(a, b)
    assert ItemIndex.load(url, threads=1).config.threads == 1
    with pytest.raises(FileExistsError, match="items.ann exists"):
        index.save(url)
    index.save(url, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["items.ann"]  # no temporaries left


def test_save_load_through_an_fsspec_url(world):
    items, ids, users = world
    index = ItemIndex.build(items[:1_000], ids[:1_000])
    url = index.save("memory://recps-ann-test/items.ann", overwrite=True)
    back = ItemIndex.load(url)
    np.testing.assert_array_equal(back.search(users, 10)[0], index.search(users, 10)[0])


def test_load_refuses_damaged_files(world, tmp_path):
    items, ids, _ = world
    path = tmp_path / "items.ann"
    ItemIndex.build(items[:1_000], ids[:1_000]).save(path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    (tmp_path / "flipped.ann").write_bytes(bytes(data))
    with pytest.raises(DataError, match="flipped.ann: checksum mismatch"):
        ItemIndex.load(tmp_path / "flipped.ann")
    (tmp_path / "short.ann").write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match="short.ann: .* bytes, its header says .*truncated"):
        ItemIndex.load(tmp_path / "short.ann")
    (tmp_path / "other.ann").write_bytes(b"not an index at all")
    with pytest.raises(DataError, match="other.ann: not a recps item index"):
        ItemIndex.load(tmp_path / "other.ann")


def test_errors_name_the_value_and_the_fix(world, exact):
    items, ids, users = world
    with pytest.raises(ConfigError, match=r"k=20001 is larger than the catalogue \(20000 items"):
        exact.search(users, N + 1)
    with pytest.raises(ConfigError, match="k=0: must be a positive integer"):
        exact.search(users, 0)
    with pytest.raises(DataError, match=r"item vectors: shape \(0, 32\); expected a non-empty"):
        ItemIndex.build(items[:0], ids[:0])
    with pytest.raises(DataError, match="query vectors: dimension 16, the index holds d=32"):
        exact.search(users[:, :16], 5)
    bad = users.copy()
    bad[3, 5] = np.nan
    with pytest.raises(DataError, match=r"query vectors: 1 row\(s\) hold NaN or inf \(first: row 3\)"):
        exact.search(bad, 5)
    bad_items = items[:100].copy()
    bad_items[[10, 20]] = np.inf
    with pytest.raises(DataError, match=r"item vectors: 2 row\(s\) hold NaN or inf \(first: row 10\)"):
        ItemIndex.build(bad_items, ids[:100])
    with pytest.raises(DataError, match="item vectors: dtype int64; expected float vectors"):
        ItemIndex.build(np.ones((5, 4), np.int64), np.arange(5))
    with pytest.raises(DataError, match=r"item ids: shape \(4,\), dtype int64; expected \(5,\)"):
        ItemIndex.build(items[:5], np.arange(4))
    with pytest.raises(DataError, match=r"item ids: 1 duplicate\(s\) \(e.g. 3\)"):
        ItemIndex.build(items[:5], np.array([1, 2, 3, 3, 4]))
    with pytest.raises(DataError, match="id -1 is reserved"):
        ItemIndex.build(items[:5], np.array([1, 2, -1, 3, 4]))
    with pytest.raises(DataError, match="zero vector.*first: item 9.*metric=cosine"):
        ItemIndex.build(np.vstack([items[:4], np.zeros((1, D), np.float32)]), np.arange(5, 10), AnnConfig(metric="cosine"))
    with pytest.raises(DataError, match=r"exclude.offsets: 3 entries for 40 query rows; CSR offsets need U \+ 1 = 41"):
        exact.search(users, 5, exclude=Seen(np.array([0, 1, 2]), np.array([1, 2])))
    with pytest.raises(DataError, match="exclude.offsets: must rise from 0 to len"):
        exact.search(users[:2], 5, exclude=Seen(np.array([0, 2, 1]), np.array([1])))
    with pytest.raises(ConfigError, match="AnnConfig.kind='annoy': not one of auto, exact, ivf, hnsw"):
        AnnConfig(kind="annoy")
    with pytest.raises(ConfigError, match="AnnConfig.metric='dot': not one of ip, cosine, l2"):
        AnnConfig(metric="dot")
    with pytest.raises(ConfigError, match="AnnConfig.threads=0: must be a positive integer"):
        AnnConfig(threads=0)
    with pytest.raises(ConfigError, match="AnnConfig.nlist=500 is more than the 100 items"):
        ItemIndex.build(items[:100], ids[:100], AnnConfig(kind="ivf", nlist=500))


def test_threads_are_bounded_per_call_and_restored(world):
    items, ids, users = world
    before = faiss.omp_get_max_threads()
    index = ItemIndex.build(items[:2_000], ids[:2_000], AnnConfig(kind="ivf", threads=1))
    index.config = dataclasses.replace(index.config, threads=2)
    index.search(users, 10)
    assert faiss.omp_get_max_threads() == before


def test_recall_at_k():
    assert recall_at_k([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert recall_at_k([[1, 2, 3], [7, 8, 9]], [[3, 4, 5], [9, 8, 7]]) == pytest.approx((1 / 3 + 1) / 2)
    assert recall_at_k([[1, 2, 3, 4, 5]], [[5, 1]]) == 1.0  # found may be wider than truth
    assert recall_at_k([[2, 1]], [[1, MISSING]]) == 1.0  # padded truth is not asked for
    with pytest.raises(DataError, match=r"found \(1, 2\) and truth \(2, 2\)"):
        recall_at_k([[1, 2]], [[1, 2], [3, 4]])
