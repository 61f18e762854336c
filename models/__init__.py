"""The recps model zoo: pure torch modules over a KeyedJaggedTensor and dense tensors.

Embedding collections are injected (a local torchrec collection or recps' PS-backed one);
`forward` returns logits; losses live in recps tasks.
"""

from models.autoint import AutoInt
from models.bst import BST
from models.ctr_dnn import CTRDNN
from models.dcn import DCN
from models.dcn_v2 import DCNv2
from models.deepfm import DeepFM
from models.din import DIN
from models.dlrm import DLRM
from models.fm import FM
from models.gru4rec import GRU4Rec
from models.esmm import ESMM
from models.lr import LR
from models.mmoe import MMoE
from models.ncf import NCF
from models.ple import PLE
from models.sasrec import SASRec
from models.shared_bottom import SharedBottom
from models.two_tower import TwoTower
from models.word2vec import Word2Vec
from models.wide_deep import WideDeep
from models.xdeepfm import XDeepFM
from models.youtube_dnn import YouTubeDNN

__all__ = ["AutoInt", "BST", "CTRDNN", "DCN", "DCNv2", "DeepFM", "DIN", "DLRM", "ESMM", "FM", "GRU4Rec", "LR", "MMoE", "NCF", "PLE",
           "SASRec", "SharedBottom", "TwoTower", "WideDeep", "Word2Vec", "XDeepFM", "YouTubeDNN"]
