"""Word2Vec: skip-gram with negative sampling (SGNS); item2vec is the same model over sessions.

Papers: Mikolov, Sutskever, Chen, Corrado, Dean, "Distributed Representations of Words and
Phrases and their Compositionality", NIPS 2013 (https://arxiv.org/abs/1310.4546); item2vec:
Barkan & Koenigstein, "Item2Vec: Neural Item Embedding for Collaborative Filtering", 2016
(https://arxiv.org/abs/1603.04259); negatives shared by many pairs so that scoring them is
a matrix product: Ji, Shah, Satish, Dubey, "Parallelizing Word2Vec in Shared and
Distributed Memory", 2016 (https://arxiv.org/abs/1604.04661).

Shapes: R token rows (a run of consecutive tokens), W the window (offsets ±1..±W, 2W of
them), K shared negatives, M = R + K bags per feature, D embedding dim, G rows per block.

Two tables of one injected bag collection (torchrec EmbeddingBagCollection, recps' local
FBGEMM one or the PS-backed one, so the model runs under ps=local|sync|async|geo): the
input vectors (word2vec's syn0, the word vectors one keeps; feature "input") and the output
vectors (syn1neg; feature "output"). Each token of the run is looked up once per table, not
once per pair: bag r < R of both features holds token r; output bags R..M-1 hold the K
negatives; input bags R..M-1 are empty. The logits are products of the looked-up rows:

    sparse KJT, stride M: input  bags: R tokens, K empty ─┐
                          output bags: R tokens, K negs  ─┴► EmbeddingBagCollection ─► (M, 2D)
    x = input rows (R, D), y = output rows (R, D), n = negative rows (K, D)
    context (R, 2W)  [r, j] = x_r · y_(r + offset_j) + bias       token r as the context of its neighbours
    negative (R, K)         = x @ n^T + bias                      every token against every negative

`context` is computed in blocks of G = 16 rows: each block against the G + 2W output rows
around it is one small matrix product (a batched (G, D) x (D, G + 2W)), whose band holds
the 2W neighbours; entries whose neighbour lies outside the run are 0 + bias (the task masks
them, and pairs across documents or beyond a reduced window).

The task (recps.tasks.skipgram.SkipGramTask) forms the run (subsampling), draws the
negatives from the unigram^0.75 distribution, masks the pairs and owns the loss.

`bias` is a learned scalar added to every logit (0 at start). SGNS has none; it is here
because the engine trains models with at least one dense parameter.

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    >>> _ = torch.manual_seed(0)
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name="t_input", embedding_dim=8, num_embeddings=10, feature_names=["input"]),
    ...     EmbeddingBagConfig(name="t_output", embedding_dim=8, num_embeddings=10, feature_names=["output"])])
    >>> model = Word2Vec(ebc, bias=False)
    >>> # a run of tokens 4, 6, 5 (R = 3) and negatives 1, 2 (K = 2): M = 5 bags per feature
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["input", "output"], torch.tensor([4, 6, 5, 4, 6, 5, 1, 2]),
    ...                                           torch.tensor([1, 1, 1, 0, 0, 1, 1, 1, 1, 1]))
    >>> context, negative = model(kjt, rows=3, window=1)
    >>> context.shape, negative.shape             # offsets (-1, +1) of each token; every token x every negative
    (torch.Size([3, 2]), torch.Size([3, 2]))
    >>> x, y = model.word_vectors(torch.tensor([4, 6, 5])), model.output_vectors(torch.tensor([4, 6, 5, 1, 2]))
    >>> torch.allclose(context[1], torch.stack([x[1] @ y[0], x[1] @ y[2]]), atol=1e-6)
    True
    >>> float(context[0, 0]), torch.allclose(negative, x @ y[3:].T)   # token 0 has no left neighbour
    (0.0, True)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout

__all__ = ["Word2Vec"]


class Word2Vec(nn.Module):
    """SGNS over an injected bag collection with an input and an output table.

    Args:
        embedding_bag_collection: torchrec EmbeddingBagCollection or recps' local / PS-backed
            one serving exactly the features `input_feature` and `output_feature` (one dim D).
        input_feature: the feature of the input (word) vectors.
        output_feature: the feature of the output (context) vectors.
        bias: add a learned scalar to every logit (see the module docstring).

    forward(sparse, rows, window) -> (context (R, 2W), negative (R, K)); see the module
    docstring for the bag layout of `sparse` (stride M = R + K).
    """

    def __init__(self, embedding_bag_collection: nn.Module, input_feature: str = "input",
                 output_feature: str = "output", bias: bool = True) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_bag_collection, "Word2Vec")
        if sorted(names) != sorted([input_feature, output_feature]) or input_feature == output_feature:
            raise ValueError(f"Word2Vec: the collection serves features {names}; it needs exactly two, "
                             f"input_feature={input_feature!r} and output_feature={output_feature!r} (two tables)")
        self.input_feature, self.output_feature = input_feature, output_feature
        self.dim = dim
        self.sparse_arch = embedding_bag_collection
        self.bias = nn.Parameter(torch.zeros(())) if bias else None

    def forward(self, sparse: KeyedJaggedTensor, rows: int,
                window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of each token against its 2W neighbours (R, 2W), offsets -W..-1, 1..W, and of
        each token against every negative (R, K)."""
        if not 0 < rows <= sparse.stride() or window < 1:
            raise ValueError(f"Word2Vec: rows={rows}, window={window} with a KJT of stride {sparse.stride()}; lay "
                             "out R >= 1 token bags, then the K negatives' bags (stride R + K), and a window >= 1")
        inputs, outputs = self._rows(sparse)  # (M, D) each
        x, y, negatives = inputs[:rows], outputs[:rows], outputs[rows:]  # (R, D), (R, D), (K, D)
        context = _band(x, y, window)  # (R, 2W)
        negative = x @ negatives.t()  # (R, K)
        if self.bias is not None:
            context, negative = context + self.bias, negative + self.bias
        return context, negative

    def word_vectors(self, ids: torch.Tensor) -> torch.Tensor:
        """Input (word) vectors (K, D) of ids (K,): what word2vec keeps."""
        return self._lookup(ids, self.input_feature)

    def output_vectors(self, ids: torch.Tensor) -> torch.Tensor:
        """Output (context) vectors (K, D) of ids (K,)."""
        return self._lookup(ids, self.output_feature)

    def _lookup(self, ids: torch.Tensor, feature: str) -> torch.Tensor:
        k = ids.numel()
        ones, zeros = torch.ones(k, dtype=torch.int64), torch.zeros(k, dtype=torch.int64)
        lengths = torch.cat([ones, zeros] if feature == self.input_feature else [zeros, ones])  # (2K,)
        kjt = KeyedJaggedTensor(keys=[self.input_feature, self.output_feature], values=ids.reshape(-1).long(),
                                lengths=lengths, stride=k)
        inputs, outputs = self._rows(kjt)  # (K, D) each
        return inputs if feature == self.input_feature else outputs

    def _rows(self, sparse: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.sparse_arch(sparse)  # KeyedTensor (M, 2D)
        first = pooled.keys().index(self.input_feature)
        x, y = pooled.values().split(self.dim, dim=1)  # (M, D) each; split's backward is one cat
        return (x, y) if first == 0 else (y, x)


_BLOCK = 16  # G: rows per block of the band product (4-16 measured alike; fewer, larger matrices)


def _band(x: torch.Tensor, y: torch.Tensor, window: int) -> torch.Tensor:
    """[r, j] = x_r · y_(r + offset_j), offsets -W..-1, 1..W; 0 where r + offset_j is outside
    the rows. x, y (R, D) -> (R, 2W), via blocks of G rows against their G + 2W neighbours."""
    rows, dim = x.shape
    blocks = -(-rows // _BLOCK)
    pad = blocks * _BLOCK - rows
    xb = F.pad(x, (0, 0, 0, pad)).view(blocks, _BLOCK, dim)  # (nb, G, D)
    # Output rows b·G - W .. b·G + G + W - 1 of each block, as one gather (an unfold's backward is slower).
    around = torch.arange(blocks, device=x.device)[:, None] * _BLOCK + torch.arange(_BLOCK + 2 * window,
                                                                                   device=x.device)  # (nb, G + 2W)
    y_pad = F.pad(y, (0, 0, window, pad + window))  # (nb·G + 2W, D), zeros outside the run
    yw = y_pad.index_select(0, around.reshape(-1)).view(blocks, _BLOCK + 2 * window, dim)  # (nb, G + 2W, D)
    products = torch.bmm(xb, yw.transpose(1, 2))  # (nb, G, G + 2W): row a of block b against its neighbours
    offsets = torch.cat([torch.arange(-window, 0), torch.arange(1, window + 1)]).to(x.device)  # (2W,)
    columns = torch.arange(_BLOCK, device=x.device)[:, None] + window + offsets[None, :]  # (G, 2W)
    band = products.gather(2, columns.expand(blocks, -1, -1))  # (nb, G, 2W)
    return band.reshape(blocks * _BLOCK, 2 * window)[:rows]  # (R, 2W)
