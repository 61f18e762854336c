"""The recps model zoo: pure torch modules over a KeyedJaggedTensor and dense tensors.

Embedding collections are injected (a local torchrec collection or recps' PS-backed one);
`forward` returns logits; losses live in recps tasks.
"""

from models.ctr_dnn import CTRDNN
from models.deepfm import DeepFM

__all__ = ["CTRDNN", "DeepFM"]
