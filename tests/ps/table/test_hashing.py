"""splitmix64, partition and Initializer: bit-exact, deterministic, well mixed."""

import pytest
import torch

from recps.errors import ConfigError
from recps.ps.table import Initializer, partition
from recps.ps.table.hashing import splitmix64

MASK = (1 << 64) - 1
EDGE_KEYS = [0, 1, -1, 2, -(2**63), 2**63 - 1, 2**62 + 3, -(2**62) - 7, 123456789012345]


def splitmix64_reference(x: int) -> int:
    """Textbook unsigned splitmix64 finalizer of x + gamma, in Python ints."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_splitmix64_equals_unsigned_reference_bit_for_bit():
    keys = torch.tensor(EDGE_KEYS, dtype=torch.int64)
    got = [v & MASK for v in splitmix64(keys).tolist()]
    assert got == [splitmix64_reference(k & MASK) for k in EDGE_KEYS]


def test_partition_is_stable_in_range_and_balanced():
    keys = torch.arange(200_000, dtype=torch.int64) * 1024  # strided keys must still spread
    for n in (2, 3, 7):
        shards = partition(keys, n)
        assert shards.min() >= 0 and shards.max() < n
        counts = torch.bincount(shards, minlength=n).double()
        assert (counts / counts.mean() - 1).abs().max() < 0.02
        assert torch.equal(shards, partition(keys.clone(), n))
    edge = torch.tensor(EDGE_KEYS)
    assert torch.equal(partition(edge, 3), partition(edge.flip(0), 3).flip(0))
    assert partition(edge, 1).eq(0).all()
    with pytest.raises(ConfigError, match="num_shards=0"):
        partition(edge, 0)


def test_initializer_is_a_function_of_key_and_seed_only():
    init = Initializer("uniform", low=-0.5, high=0.5)
    keys = torch.tensor(EDGE_KEYS)
    full = init(keys, 8, seed=7)
    # The same key gives the same row whatever batch it comes in.
    assert torch.equal(init(keys[3:5], 8, seed=7), full[3:5])
    assert torch.equal(init(keys.flip(0), 8, seed=7), full.flip(0))
    assert not torch.equal(init(keys, 8, seed=8), full)
    assert full.min() >= -0.5 and full.max() < 0.5
    # Columns are not copies of each other.
    assert (full[:, 0] != full[:, 1]).all()


def test_uniform_initializer_is_splitmix64_per_key_and_column_bit_for_bit():
    # The compiled loop against the definition in torch ops: hash h = splitmix64(base + (c+1)
    # gamma) of base = splitmix64(key + mix(seed ^ salt)); its top 23 bits are u in [0, 1).
    from recps.ps.table.hashing import _GAMMA, _INIT_SALT, _splitmix64_int, _srl

    keys = torch.tensor(EDGE_KEYS + list(range(-50, 50)), dtype=torch.int64)
    dim, seed, low, high = 5, 11, -0.3, 0.7
    base = splitmix64(keys, _splitmix64_int(seed ^ _INIT_SALT))  # (K,)
    cols = torch.arange(1, dim + 1, dtype=torch.int64) * _GAMMA  # (D,)
    h = splitmix64(base[:, None], cols)  # (K, D)
    u = _srl(h, 41).to(torch.float32) / float(1 << 23)  # exact: 23-bit integers
    expect = u * torch.tensor(high - low, dtype=torch.float32) + torch.tensor(low, dtype=torch.float32)
    got = Initializer("uniform", low=low, high=high)(keys, dim, seed=seed)
    assert torch.equal(got, expect)
    # Written into a strided block (a table's value columns) the same.
    block = torch.full((keys.numel(), dim + 3), 9.0)
    Initializer("uniform", low=low, high=high)(keys, dim, seed=seed, out=block[:, :dim])
    assert torch.equal(block[:, :dim], expect) and block[:, dim:].eq(9.0).all()


def test_initializer_distributions():
    keys = torch.arange(100_000, dtype=torch.int64)
    u = Initializer("uniform", low=1.0, high=3.0)(keys, 4, seed=0)
    assert abs(u.mean().item() - 2.0) < 0.01 and abs(u.var().item() - 4 / 12) < 0.01
    n = Initializer("normal", mean=0.5, std=2.0)(keys, 4, seed=0)
    assert abs(n.mean().item() - 0.5) < 0.03 and abs(n.std().item() - 2.0) < 0.03
    assert torch.isfinite(n).all()
    assert Initializer("zeros")(keys[:3], 4).eq(0).all()
    with pytest.raises(ConfigError, match="kind='gauss'"):
        Initializer("gauss")
