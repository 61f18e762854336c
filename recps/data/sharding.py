"""Input sharding over a cluster's workers and their training threads."""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["WorkerShards"]


class WorkerShards:
    """A BatchSource view for one worker: trainer thread t of T reads shard worker*T + t of W*T."""

    def __init__(self, source, worker_index: int, num_workers: int) -> None:
        self.source, self.worker_index, self.num_workers = source, worker_index, num_workers

    def batches(self, batch_size: int, shard_index: int, num_shards: int, epoch: int) -> Iterator:
        return self.source.batches(batch_size, self.worker_index * num_shards + shard_index,
                                   self.num_workers * num_shards, epoch)

    def shard_batches(self, batch_size: int, threads: int) -> list[int]:
        """Batches per epoch of every one of the W*T shards (sync mode takes the minimum)."""
        rows = len(self.source)
        n = self.num_workers * threads
        return [-(-len(range(s, rows, n)) // batch_size) for s in range(n)]
