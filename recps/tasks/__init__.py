"""Tasks own the losses and the evaluation; models only return logits."""

from recps.tasks.base import Task, TaskBase, check_label_range
from recps.tasks.binary import BinaryTask

__all__ = ["Task", "TaskBase", "BinaryTask", "check_label_range"]
