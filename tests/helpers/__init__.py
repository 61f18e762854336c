"""Shared test helpers (not tests): pytest collects nothing here.

- cli.py: `run_module` / `recps_train` (`python -m ...` from the checkout; return code, output, run
  folder; a failure names the command with the tail of its output), `job_process`, `follow_launch`;
- cluster.py: every shape of PS cluster the tests start (servers on threads, a job's server 0 and
  worker 0, a server with two worker threads, role processes as torchrun starts them);
- counting.py: the counting model (`task._target_=tests.helpers.counting.CountingTask`);
- threads.py: `run_threads`, `call_in_threads`, `wait_until` (every wait has a bound);
- reference.py: the plain-torch twin of a small PS CTR-DNN (GEO and device tests);
- streams.py: a stream's statistics recomputed from its data and its saved tables.
"""
