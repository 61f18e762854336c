"""Tasks own the losses and the evaluation; models only return logits."""

from recps.tasks.binary import BinaryTask

__all__ = ["BinaryTask"]
