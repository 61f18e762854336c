"""One cluster: starting and supervising processes, the driver of a PS job, the role bodies, PS checkpoints.

    launch       start S servers and W workers of one command on this machine and supervise them
                 (restarts, timeouts, output forwarding, a forked preloaded image); `python -m recps.launch`
    driver       a `python -m recps.train ps=sync|async|geo` job: the checks before any process starts,
                 the launch of its processes (recps-job.yaml, child_command), its storage roots; a
                 process that finds its role in the environment runs that role's body (run_role)
    process      this process as a node: its Fleet with the job's cluster settings, where it runs, its logs
    server       a server's role body (`serve`), and `python -m recps.ps`'s (`main`)
    work         a batch job's worker role body: train, evaluate, commit the PS checkpoint
    checkpoint   PS checkpoints of a running job and resumes: progress records, worker states and their
                 merge, mid-run pauses, the resume point, the restart's checkpoint

Nothing is re-exported here: `python -m recps.launch` imports recps.cluster.launch alone (no torch).
`recps.ps.roles` (which process am I) and `recps.ps.node.join` (a node from its Role) live below, in
the PS: the nodes and the Fleet read them, and the layers point down.
"""
