"""The training loop of every job: several Hogwild threads over their own shards of the input.

Each thread owns a replica of the model's dense layers whose parameters alias the shared
storage (so every thread reads the latest values) but whose `.grad` is its own; the
embedding collection is shared, and FBGEMM's fused optimizer (or the parameter server's
communicator) updates it inside the backward pass. Dense gradients are applied by one
`DenseUpdater` under a lock: the shared optimizer's state is never touched by two
threads at once (with several threads, in torch's fused step where the optimizer has one:
`fused_dense_steps`). After each step every thread calls `updater.step_end(thread)`: a no-op
locally; with a parameter server it ends the step on the communicator (sync: the step's
barrier; geo: counts towards k) and refreshes the shared dense parameters
(recps.ps.modes.dense).

A collection that counts CTR statistics (a PS collection's `set_batch_clicks`, recps.ps.embedding)
gets each batch's clicks (B,) around the forward pass: `click_labels(task, batch)`.

Precision (`trainer.precision`): recps.job.precision.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import torch
from torch import nn

from recps.data.batch import Batch
from recps.data.dataset import ExamplesSource
from recps.data.sharding import WorkerShards
from recps.errors import ConfigError
from recps.embeddings.placement import BatchPlacement
from recps.job.observer import TrainObserver
from recps.job.precision import Precision, check_precision
from recps.ps.modes.dense import LocalDenseUpdater  # re-exported: recps.job.loop.LocalDenseUpdater (ps=local)

__all__ = ["BatchSource", "DenseUpdater", "LocalDenseUpdater", "Pauses", "TrainStats", "Trainer", "click_labels",
           "dense_parameters", "fused_dense_steps", "left_of_target", "planned_steps", "thread_replica"]

log = logging.getLogger(__name__)


class BatchSource(Protocol):
    """Yields the batches of shard `shard_index` of `num_shards` for one epoch."""

    def batches(self, batch_size: int, shard_index: int, num_shards: int,
                epoch: int) -> Iterator[Batch]: ...


class DenseUpdater(Protocol):
    """Applies one thread's dense gradients to the shared dense parameters; `step_end(thread)`
    follows every step of every thread."""

    def apply(self, grads: Sequence[torch.Tensor | None]) -> None: ...

    def step_end(self, thread: int) -> None: ...


class Pauses(Protocol):
    """Where a fit stops every thread at a step boundary (a consistent checkpoint, recps.cluster.checkpoint).

    `first()` is the step count (over all threads of the fit) of the first pause, None for none;
    `pause(steps, positions)` runs once no thread is inside a step, every one stopped before its
    next (positions: per thread (epoch, batches of it trained)), and returns the next pause's step
    count (greater than `steps`) or None. A pause whose step count the threads cannot reach (their
    batches ran out) runs when the last of them stops, with the steps they took, and so does each
    one `pause` returns after it, until it returns None."""

    def first(self) -> int | None: ...

    def pause(self, steps: int, positions: list[tuple[int, int]]) -> int | None: ...


def planned_steps(batches: Sequence[int], epochs: int, max_steps: int = -1, thread_steps_per_epoch: int = -1,
                  skip: Sequence[int] | None = None) -> int:
    """The steps `Trainer.fit` takes over all threads, thread t having `batches[t]` batches per epoch."""
    total = 0
    for t, n in enumerate(batches):
        per_epoch = min(n, thread_steps_per_epoch) if thread_steps_per_epoch > 0 else n
        total += max(0, per_epoch * epochs - (skip[t] if skip else 0)) if epochs > 0 else 0
    return min(total, max_steps) if max_steps > 0 else total


def left_of_target(epochs: int, max_steps: int, origin: tuple[int, int], epoch: int, steps: int) -> tuple[int, int]:
    """(epochs, max_steps) for a restarted job that resumes at `epoch` with `steps` done, so that it
    stops where the job it continues would have: that job began at `origin` = (epoch, steps) ((0, 0),
    or the checkpoint a user resumed) and trains `epochs` epochs from there (`fit`'s epochs
    first_epoch .. first_epoch + epochs - 1), or `max_steps` steps if > 0. Nothing left: (0, -1).

    >>> left_of_target(2, -1, (1, 100), 1, 130)   # resumed at epoch 1, restarted 30 steps into it
    (2, -1)
    >>> left_of_target(2, -1, (1, 100), 2, 260)
    (1, -1)
    >>> left_of_target(1, 500, (1, 100), 1, 430), left_of_target(1, 500, (1, 100), 2, 600)
    ((1, 170), (0, -1))
    """
    start_epoch, start_steps = origin
    epochs = max(0, start_epoch + epochs - epoch)
    if max_steps > 0:
        max_steps = start_steps + max_steps - steps
        if max_steps <= 0:
            return 0, -1
    return epochs, max_steps


def click_labels(task, batch: Batch) -> torch.Tensor | None:
    """(B,) the click of each example of `batch`, for the parameter servers' CTR statistics (shows
    and clicks per key), or None when the task's labels are no clicks (the servers then count shows
    only): the task's own `click_labels(batch)` if it has one; else, for a task that hands
    batch.sparse to the model, the label column it trains on (`label_index`: BinaryTask,
    RetrievalTask; the first of `label_indices`: MultiTask, ESMM's click); else None (next-item,
    skip-gram). The collection clamps each to [0, 1]."""
    own = getattr(task, "click_labels", None)
    if own is not None:
        return own(batch)
    if not getattr(task, "passes_batch_sparse", False):
        return None
    column = getattr(task, "label_index", None)
    if column is None:
        columns = getattr(task, "label_indices", None)
        column = columns[0] if columns else None
    if column is None or batch.labels.dim() != 2 or not 0 <= int(column) < batch.labels.shape[1]:
        return None
    return batch.labels[:, int(column)]  # (B,)


@dataclass
class TrainStats:
    steps: int
    examples: int
    seconds: float
    last_loss: float
    first_losses: list[float]
    positions: list[tuple[int, int]] | None = None  # per thread: (epoch, batches of it trained)

    @property
    def examples_per_sec(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0


# torch optimizers with a fused step (one kernel per parameter, no per-op Python) and where it runs.
_FUSED_DEVICES = {torch.optim.Adam: ("cpu", "cuda"), torch.optim.AdamW: ("cpu", "cuda"),
                  torch.optim.SGD: ("cpu", "cuda"), torch.optim.Adagrad: ("cpu",)}


@contextlib.contextmanager
def fused_dense_steps(updater: DenseUpdater, enabled: bool = True):
    """Within the block, the dense optimizer of a local updater (LocalDenseUpdater; GEO's replica)
    takes torch's fused step where it has one and the user left the choice open (fused=None,
    foreach=None): Adam, AdamW, SGD, Adagrad over dense floating parameters on a device their fused
    kernel covers. The Hogwild threads (Trainer, threads > 1) apply their gradients one at a time
    under the updater's lock; the fused step holds it (and the GIL) for a fraction of the time:
    measured here ~0.23 against ~0.65 ms for CTR-DNN's Adam, 72 against 260 aten ops a step. Its
    results differ from the loop's in the last bits (another order of the same arithmetic), which
    is why one thread, whose runs are deterministic, keeps the user's step. Checkpoints taken inside
    the block record the user's setting (fused=None), not this one.

    >>> p = nn.Parameter(torch.ones(2)); opt = torch.optim.Adam([p])
    >>> with fused_dense_steps(LocalDenseUpdater([p], opt)):
    ...     opt.param_groups[0]["fused"], opt.state_dict()["param_groups"][0]["fused"]
    (True, None)
    >>> opt.param_groups[0]["fused"] is None
    True
    """
    optimizer = getattr(updater, "optimizer", None) if enabled and isinstance(updater, LocalDenseUpdater) else None
    devices = _FUSED_DEVICES.get(type(optimizer))  # exactly these classes: a subclass may step otherwise
    switched = [i for i, g in enumerate(optimizer.param_groups)
                if g.get("fused") is None and g.get("foreach") is None and not g.get("differentiable")
                and all(p.is_floating_point() and not p.is_sparse and p.device.type in devices for p in g["params"])
                ] if devices else []
    if not switched:
        yield
        return

    def user_setting(_optimizer, state: dict) -> dict:
        for i in switched:
            state["param_groups"][i]["fused"] = None
        return state

    for i in switched:
        optimizer.param_groups[i]["fused"] = True
    hook = optimizer.register_state_dict_post_hook(user_setting)
    try:
        yield
    finally:
        hook.remove()
        for i in switched:
            optimizer.param_groups[i]["fused"] = None


def dense_parameters(model: nn.Module, collection: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters that the embedding collection does not own."""
    owned = {id(p) for p in collection.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in owned]


def thread_replica(model: nn.Module, collection: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
    """A copy of `model` that shares `collection` and aliases every dense parameter's storage."""
    replica = copy.deepcopy(model, memo={id(collection): collection})
    shared = [p for _, p in dense_parameters(model, collection)]
    mine = [p for _, p in dense_parameters(replica, collection)]
    for own, src in zip(mine, shared):
        own.data = src.data  # same storage, separate .grad
    return replica, mine


class Trainer:
    """Runs `threads` training threads over a model whose collection trains itself.

    Args:
        model: the model; its `forward(dense, sparse)` returns logits.
        collection: the embedding collection inside `model` (updated in backward).
        task: owns the loss (`task.loss(logits, batch)`).
        updater: applies dense gradients (local optimizer or a PS communicator).
        threads: Hogwild training threads in this process.
        on_step: called as on_step(thread, step, loss) after every step.
        observers: `TrainObserver`s (metrics reporter, debug dump); none costs nothing. One that
            has `on_fit_plan(steps)` gets, before `on_fit_start`, the steps each fit will take over
            all threads (`planned_steps`; None when the source cannot say how many batches its shards
            hold; at most max_steps): the debug dump sizes itself with it.
        prefetch: each thread hands its next batch's sparse features to `collection.prefetch`
            between the current batch's forward and backward passes (a PS collection in async
            mode starts the pulls then: recps.ps.embedding), if the task's forward passes
            batch.sparse to the model as it is (`task.passes_batch_sparse`).
        precision: "fp32", "bf16" or "fp16" (CUDA), checked against `device` (check_precision),
            or a `Precision`: the forward passes of `fit` and `predict` run under its autocast.
        device: where the dense part computes ("cpu", "cuda", "cuda:N"): autocast's device type.
    """

    def __init__(self, model: nn.Module, collection: nn.Module, task, updater: DenseUpdater,
                 threads: int = 1, on_step: Callable[[int, int, float], None] | None = None,
                 observers: Sequence[TrainObserver] = (), prefetch: bool = False,
                 precision: str | Precision = "fp32", device: str = "cpu") -> None:
        if threads < 1:
            raise ConfigError(f"trainer.threads={threads}; set it to 1 or more")
        if not isinstance(precision, Precision):
            precision = Precision(check_precision(precision, device), device)
        self.precision = precision
        self.model = model
        self.collection = collection
        self.task = task
        self.updater = updater
        self.threads = threads
        self.on_step = on_step
        self.observers = list(observers)
        self.prefetch = prefetch
        self._replicas = [thread_replica(model, collection) for _ in range(threads)]
        # device=cuda: each thread's batches are copied up one step ahead (recps.embeddings.placement); on
        # the CPU the batches as they are. The KJT goes where the collection reads its keys when the
        # task hands it over as it is; a task that builds its own from it (sequences) gets it on the device.
        passes = getattr(task, "passes_batch_sparse", False)
        self.placement = BatchPlacement(device, getattr(collection, "input_device", None) if passes else None)

    def fit(self, source: BatchSource, batch_size: int, epochs: int = 1, max_steps: int = -1,
            progress: bool = True, first_epoch: int = 0, thread_steps_per_epoch: int = -1,
            skip: Sequence[int] | None = None, pauses: Pauses | None = None) -> TrainStats:
        """Trains for `epochs` passes (or `max_steps` steps over all threads, if > 0).

        `thread_steps_per_epoch` > 0 caps the batches each thread takes per epoch (sync mode:
        every thread of every worker must take the same number of steps). `skip[t]`: batches of
        `first_epoch` thread t trained before (a resumed run continues where it stopped); the
        stats' `positions` say where each thread stopped. `pauses`: where every thread stops
        for a checkpoint (see `Pauses`); the thread that completes a pause's last step runs it."""
        if skip is not None and len(skip) != self.threads:
            raise ConfigError(f"Trainer.fit: skip has {len(skip)} entries for {self.threads} threads")
        if self.precision.scaler is not None and not isinstance(self.updater, LocalDenseUpdater):
            # fp16 skips a step whose gradients overflowed; a sync server would wait for it forever.
            raise ConfigError(f"trainer.precision=fp16 with {type(self.updater).__name__}: a skipped step cannot "
                              "reach the servers' dense update; use trainer.precision=bf16, or ps=local / ps=geo")
        lock = threading.Condition()
        # reserved: steps a thread has claimed before training them, so that max_steps and a pause's
        # step count are exact over all threads (a thread finishing step max_steps cannot stop the
        # others' steps in flight; no thread starts a step past a pause before it ran).
        # pause_at: the step count of the next pause (None: none); running: threads not yet done;
        # waiting: threads stopped before a pause; pausing: a thread runs the pause.
        state = {"steps": 0, "reserved": 0, "examples": 0, "loss": math.nan, "first": [],
                 "pause_at": pauses.first() if pauses is not None else None, "running": self.threads,
                 "waiting": 0, "pausing": False}
        skipped = list(skip) if skip is not None else [0] * self.threads
        positions = [(first_epoch, skipped[t]) for t in range(self.threads)]
        errors: list[BaseException] = []
        stop = threading.Event()
        bar = _progress_bar(progress)
        observers = list(self.observers)
        plan_hooks = [hook for hook in (getattr(obs, "on_fit_plan", None) for obs in observers) if hook is not None]
        if plan_hooks:
            batches = _thread_batches(source, batch_size, self.threads)
            planned = (planned_steps(batches, epochs, max_steps, thread_steps_per_epoch, skip) if batches is not None
                       else max_steps if max_steps > 0 else None)
            for hook in plan_hooks:
                hook(planned)
        for obs in observers:
            obs.on_fit_start([replica for replica, _ in self._replicas])

        # Only a task that hands batch.sparse to the model as it is can have it prefetched.
        wanted = self.prefetch and getattr(self.task, "passes_batch_sparse", False)
        prefetch = getattr(self.collection, "prefetch", None) if wanted else None
        set_clicks = getattr(self.collection, "set_batch_clicks", None)  # a PS collection's CTR statistics
        precision = self.precision

        def pause_now() -> None:
            """Run the pause (lock not held; no thread is inside a step), then let the threads go on."""
            with lock:
                steps, where = state["steps"], list(positions)
            following = pauses.pause(steps, where)
            if following is not None and following <= steps:
                raise RuntimeError(f"Pauses.pause returned step {following}, not after step {steps}")
            with lock:
                state["pause_at"], state["pausing"] = following, False
                lock.notify_all()

        def reserve() -> bool:
            """Claim the next step; False: stop (max_steps reached, or another thread failed)."""
            with lock:
                while True:
                    if stop.is_set() or (max_steps > 0 and state["reserved"] >= max_steps):
                        return False  # (max_steps) the others train the last reserved steps
                    at = state["pause_at"]
                    if at is None or state["reserved"] < at:
                        state["reserved"] += 1
                        return True
                    # Stopped before the pause; the thread completing its last step runs it, or this
                    # one, if every other thread ran out of batches before reaching it.
                    if (not state["pausing"] and state["steps"] == state["reserved"]
                            and state["waiting"] + 1 == state["running"]):
                        state["pausing"] = True
                        break
                    state["waiting"] += 1
                    lock.wait(1.0)  # bounded: the pause's own waits are (and stop / errors wake us)
                    state["waiting"] -= 1
            pause_now()
            return reserve()

        def run(thread: int) -> None:
            replica, params = self._replicas[thread]
            try:
                for obs in observers:
                    obs.on_thread_start(thread)
                for epoch in range(first_epoch, first_epoch + epochs):
                    batches = source.batches(batch_size, thread, self.threads, epoch)
                    done = skipped[thread] if epoch == first_epoch else 0
                    if done:
                        batches = itertools.islice(batches, done, None)
                    batches = self.placement(batches)
                    positions[thread] = (epoch, done)
                    for taken, (batch, following) in enumerate(_with_next(batches), start=done):
                        if stop.is_set():
                            return
                        if 0 < thread_steps_per_epoch <= taken:
                            break
                        if not reserve():
                            return
                        scale = precision.begin_step()  # fp16: the loss scale of this step; else 1.0
                        if set_clicks is not None:
                            set_clicks(click_labels(self.task, batch))  # (B,) or None
                        try:
                            with precision.autocast():  # fp32: no-op
                                logits = self.task.forward(replica, batch)  # (B,) or the task's output
                        finally:
                            if set_clicks is not None:
                                set_clicks(None)
                        logits = precision.to_fp32(logits)  # the loss and the observers see fp32
                        loss = self.task.loss(logits, batch)
                        if prefetch is not None and following is not None and not 0 < thread_steps_per_epoch <= taken + 1:
                            prefetch(following.sparse)  # its pulls travel while this batch's backward runs
                        (loss * scale if scale != 1.0 else loss).backward()
                        for obs in observers:
                            obs.after_backward(thread)
                        grads = [p.grad for p in params]
                        if precision.end_step(grads):  # fp16: unscaled; False: not finite, skipped
                            self.updater.apply(grads)
                        for p in params:
                            p.grad = None
                        self.updater.step_end(thread)
                        value = float(loss.detach())
                        with lock:
                            positions[thread] = (epoch, taken + 1)
                            state["steps"] += 1
                            state["examples"] += batch.batch_size
                            state["loss"] = value
                            if len(state["first"]) < 10:
                                state["first"].append(value)
                            step = state["steps"]
                            pause = step == state["pause_at"] == state["reserved"] and not state["pausing"]
                            state["pausing"] = state["pausing"] or pause
                            if bar is not None:
                                bar.update(batch.batch_size)
                                if step % 20 == 0:
                                    bar.set_postfix(loss=f"{value:.4f}", refresh=False)
                        if pause:
                            pause_now()
                        for obs in observers:
                            obs.on_batch(thread, step, epoch, batch, logits, value)
                        if self.on_step is not None:
                            self.on_step(thread, step, value)
                        if 0 < max_steps <= step:
                            stop.set()
                            return
                    for obs in observers:
                        obs.on_epoch_end(thread, epoch)
            except BaseException as exc:  # surfaced in the caller's thread below
                errors.append(exc)
                stop.set()
            finally:
                with lock:
                    state["running"] -= 1
                    lock.notify_all()  # a thread waiting before a pause may now be the last one
                if prefetch is not None and not errors:
                    try:
                        self.collection.drop_prefetch()  # a batch prefetched but never trained (max_steps)
                    except BaseException as exc:  # noqa: BLE001 - as above
                        errors.append(exc)

        intra = max(1, torch.get_num_threads() // self.threads) if self.threads > 1 else None
        previous = torch.get_num_threads()
        if intra is not None:
            torch.set_num_threads(intra)
        unscale_hook = precision.unscaled_rows(self.collection)  # fp16 only
        start = time.perf_counter()
        try:
            if self.threads == 1:
                run(0)  # the user's optimizer step as it is: one thread's run is deterministic, bit for bit
            else:
                workers = [threading.Thread(target=run, args=(t,), name=f"train-{t}", daemon=True)
                           for t in range(self.threads)]
                with fused_dense_steps(self.updater):
                    for w in workers:
                        w.start()
                    for w in workers:
                        w.join()
        finally:
            seconds = time.perf_counter() - start
            torch.set_num_threads(previous)
            if unscale_hook is not None:
                unscale_hook.remove()
            if bar is not None:
                bar.close()
        # Pauses the threads never reached (their batches ran out first): taken where they stopped.
        while not errors and not (0 < max_steps <= state["steps"]) and state["pause_at"] is not None:
            try:
                pause_now()
            except BaseException as exc:  # noqa: BLE001 - raised below, after the observers
                errors.append(exc)
        for obs in observers:
            obs.on_fit_end(failed=bool(errors))
        if errors:
            raise errors[0]
        return TrainStats(steps=state["steps"], examples=state["examples"], seconds=seconds,
                          last_loss=state["loss"], first_losses=state["first"], positions=list(positions))

    @torch.no_grad()
    def predict(self, source: BatchSource, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilities (fp32) and targets (N,) over one pass of `source` (one shard), the forward
        in the trainer's precision."""
        probs, targets = [], []
        self.model.eval()
        try:
            for batch in self.placement(source.batches(batch_size, 0, 1, 0)):
                with self.precision.autocast():  # as trained
                    output = self.task.forward(self.model, batch)
                probs.append(self.task.predict(self.precision.to_fp32(output)))
                targets.append(self.task.target(batch))
        finally:
            self.model.train()
        if not probs:
            raise ConfigError("the evaluation split is empty; give dataset.test files or a test_fraction > 0")
        return torch.cat(probs).cpu(), torch.cat(targets).cpu()  # on the host (the CPU: themselves)


def _thread_batches(source, batch_size: int, threads: int) -> list[int] | None:
    """Batches per epoch of each of this process's `threads` shards of `source`, or None when the
    source cannot say: a worker's share (recps.data.sharding.WorkerShards: its T of the W*T shards)
    or in-memory examples (recps.data.dataset.ExamplesSource: thread t reads every T-th example)."""
    if isinstance(source, ExamplesSource):
        source = WorkerShards(source, 0, 1)
    if not isinstance(source, WorkerShards) or not isinstance(source.source, ExamplesSource):
        return None
    first = source.worker_index * threads
    return source.shard_batches(batch_size, threads)[first:first + threads]


def _with_next(batches) -> Iterator[tuple[Batch, Batch | None]]:
    """(batch, the batch after it or None) for each batch."""
    it = iter(batches)
    current = next(it, None)
    while current is not None:
        following = next(it, None)
        yield current, following
        current = following


def _progress_bar(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm  # deferred: tqdm, only for a progress bar (ps=local, progress=true)

    return tqdm(unit="ex", unit_scale=True, dynamic_ncols=True, mininterval=0.5, smoothing=0.1)
