"""Parameter-server tables (layer L0): storage and update rules, pure and single-process.

SparseTable maps int64 keys to embedding rows with a vectorized hash map, server-side
update rules, CTR statistics with admission and shrink, and full/delta/base/batch checkpoints
that re-shard by `partition`, optionally under a RAM budget with its other rows on a disk tier
(recps.ps.table.tier). DenseTable holds named dense parameters. Nothing here
imports the transport.
"""

from recps.ps.table._kernels import warm_up_kernels
from recps.ps.table.accessor import CountFilterEntry, CtrAccessor, ProbabilityEntry
from recps.ps.table.checkpoint import CheckpointError
from recps.ps.table.dense import DenseTable
from recps.ps.table.hashing import PARTITION_SCHEME, Initializer, partition
from recps.ps.table.key_index import KeyIndex
from recps.ps.table.keys import as_keys, unique_keys
from recps.ps.table.optimizers import AdagradRule, AdamRule, RowWiseAdagradRule, SGDRule, UpdateRule, make_rule
from recps.ps.table.sparse import SAVE_MODES, SparseTable

__all__ = [
    "SparseTable",
    "DenseTable",
    "KeyIndex",
    "as_keys",
    "unique_keys",
    "partition",
    "PARTITION_SCHEME",
    "Initializer",
    "UpdateRule",
    "SGDRule",
    "AdagradRule",
    "RowWiseAdagradRule",
    "AdamRule",
    "make_rule",
    "CtrAccessor",
    "CountFilterEntry",
    "ProbabilityEntry",
    "CheckpointError",
    "SAVE_MODES",
    "warm_up_kernels",
]
