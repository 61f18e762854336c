"""One job: built once from the composed config into typed objects, run by one training loop with hooks.

    settings     JobSettings (trainer, checkpoint, observers' settings, the config's YAML): typed, built once
    parts        Job: the built parts
    build        build_job(cfg) -> Job: data, collection, model, task, optimizer, trainer, observers;
                 the only modules here that read the composed config: build and settings
    loop         the training loop (Trainer.fit: Hogwild threads; hooks: updater, prefetch, on_step,
                 observers, pauses) and the step arithmetic of resumes (planned_steps, left_of_target)
    precision    mixed precision of the loop (fp32, bf16, fp16 with a loss scale)
    observer     TrainObserver: the hooks observers implement (metrics, debug dump, benchmarks)
    run          one fit with its observers (train, Fit), evaluate, a local run (run_local)
    checkpoint   the checkpoint formats: a local one (save, load) and a PS one's manifest (commit, verify)

The four bodies that train, and what each does differently around the same loop:

    local run      recps.job.run.run_local: a local collection (FBGEMM's fused optimizer), the
                   LocalDenseUpdater; resumes a local checkpoint (epochs and steps done); fits the
                   data set once (trainer.epochs or max_steps, a progress bar); evaluates the
                   held-out split; saves checkpoint.pt + config.yaml.
    PS worker      recps.cluster.work.work: the same job over a PS-backed collection; Fleet's
                   distributed optimizer's updater and prefetch; its shards of the data
                   (WorkerShards); a resume point per thread (skip) from a PS checkpoint and, after
                   a restart, only what is left of the job; sync: equal steps per thread; mid-run
                   checkpoints as the loop's pauses; worker 0's progress line; the throughput summed
                   through the servers; worker 0 evaluates with the servers' values and commits
                   the PS checkpoint.
    stream pass    recps.stream.pass_loop.PassLoop: the same job built once, fitted once per pass
                   (one epoch on the pass's rows, first_epoch = passes done), each pass evaluated
                   before training and followed by saves (delta, checkpoint, day end) and donefiles;
                   restarts resume from its records.
    funnel stage   recps.pipeline.runner / recps.pipeline.incremental: one model per stage, built from
                   the stage's spec (its own mode, task, optimizer, dense table `<stage>_dense`), trained
                   with the loop's Trainer on examples the upstream stages produce; exported after it.
                   (The funnel still builds its stages itself: see recps.pipeline.)

Layers: recps.job sits with the engine's parts (metrics, debug, tasks, data, embeddings) and above
the PS; recps.cluster, recps.stream and recps.pipeline build on it. Nothing is imported here.
"""
