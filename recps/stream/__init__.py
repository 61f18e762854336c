"""Streaming incremental training: Paddle's online trainer's pass loop over time-partitioned data.

`stream=hourly` (conf/stream/hourly.yaml): recps.stream.plan (days, passes, what each saves),
recps.stream.source (waiting for splits, this worker's share), recps.stream.donefile (Paddle's
donefiles, committed atomically), recps.stream.pass_loop (the loop, exactly-once restarts). It takes
typed values (StreamConfig, StreamWork); recps.train builds them from the composed config.
"""

from recps.stream.plan import Pass, StreamConfig, StreamPlan, with_start_day
from recps.stream.pass_loop import PassLoop, StreamWork, check_stream_out, nothing_left, resume_point, stream_work

__all__ = ["Pass", "StreamConfig", "StreamPlan", "PassLoop", "StreamWork", "check_stream_out", "nothing_left",
           "resume_point", "stream_work", "with_start_day"]
