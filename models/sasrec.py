"""SASRec: self-attentive sequential recommendation.

Paper: Kang & McAuley, "Self-Attentive Sequential Recommendation", ICDM 2018
(https://arxiv.org/abs/1808.09781). As there, the item table is shared between input and
output and a learned position embedding is added; the blocks are pre-LayerNorm (the
paper's code normalises before attention and the feed-forward too). The loss lives in
recps.tasks.NextItemTask: softmax cross-entropy over all items (the paper sampled one
negative for a binary loss; the full softmax trains markedly better, Klenitskiy & Vasilev,
RecSys 2023, https://arxiv.org/abs/2309.07602).

Shapes: B rows, L their longest length (<= max_len), N = the positions of the batch (sum of
row lengths), D embedding dim, C items.

    sparse KJT (B rows, jagged item ids) ┐
    all item ids 0..C-1 ─────────────────┴─► EmbeddingCollection (injected) ─► clicks (N, D), items (C, D)
                                                  │                                          │
    clicks·√D ─► pad (B, L, D) + positions (L, D) ─► dropout                                 │
       ─► num_blocks × [x + CausalSelfAttention(LN(x)); x + FFN(LN(x))] ─► LN ─► (B, L, D)   │
       ─► valid positions (N, D) ─► x items^T ──────────────────────────────────────► scores (N, C)

Position p of a row attends to positions 0..p of that row only (causal mask); rows are
right-padded, so padding never reaches a real position, and the output at position p
scores the item that follows the p-th click. Rows longer than `max_len` are refused: the
reader windows long sessions (recps.data.sessions.SequenceSource(max_len=...)).

Example:
    >>> import torch
    >>> from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
    >>> _ = torch.manual_seed(0)
    >>> ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t_item", embedding_dim=8, num_embeddings=20,
    ...                                                  feature_names=["item"])])
    >>> model = SASRec(ec, max_len=5, num_heads=2).eval()
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["item"], torch.tensor([4, 7, 1, 9, 9]), torch.tensor([3, 2]))
    >>> scores = model(kjt)
    >>> scores.shape                                 # 5 positions x 20 items
    torch.Size([5, 20])
    >>> prefix = KeyedJaggedTensor.from_lengths_sync(["item"], torch.tensor([4, 7]), torch.tensor([2]))
    >>> torch.allclose(model(prefix), scores[:2], atol=1e-5)   # causal: later clicks change nothing before them
    True
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout

__all__ = ["SASRec"]


class SASRec(nn.Module):
    """SASRec over an injected item EmbeddingCollection (one feature, tied input/output rows).

    Args:
        embedding_collection: torchrec EmbeddingCollection or recps' local / PS-backed one
            with exactly one feature (the clicked item); its table's num_embeddings is C and
            its ids must be 0..C-1.
        max_len: the longest row (positions with an embedding).
        num_blocks: self-attention blocks.
        num_heads: attention heads (must divide D).
        dropout: on the input, attention weights and feed-forward outputs.

    forward(sparse) -> scores (N, C), one row of item scores per click, in KJT order.
    """

    def __init__(self, embedding_collection: nn.Module, max_len: int = 50, num_blocks: int = 2, num_heads: int = 1,
                 dropout: float = 0.2) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_collection, "SASRec")
        if len(names) != 1:
            raise ValueError(f"SASRec: the collection serves features {names}; it needs exactly one, the clicked "
                             "item (its table scores every item)")
        if dim % num_heads:
            raise ValueError(f"SASRec: num_heads={num_heads} does not divide embedding_dim={dim}; pick a divisor")
        if max_len < 1:
            raise ValueError(f"SASRec: max_len={max_len}; use 1 or more")
        self.feature = names[0]
        self.num_items = int(embedding_collection.embedding_configs()[0].num_embeddings)
        self.dim = dim
        self.max_len = int(max_len)
        self.sparse_arch = embedding_collection
        self.positions = nn.Embedding(self.max_len, dim)
        self.input_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, num_heads, dim_feedforward=dim, dropout=dropout, activation="relu",
                                       batch_first=True, norm_first=True)
            for _ in range(num_blocks)
        )
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Scores (N, C) of every item after each click."""
        clicks = sparse[self.feature]
        lengths = clicks.lengths()  # (B,)
        b, n = lengths.numel(), clicks.values().numel()
        longest = int(lengths.max()) if b else 0
        if longest > self.max_len:
            raise ValueError(f"SASRec: a row of {longest} clicks exceeds max_len={self.max_len}; window the "
                             "sessions in the reader (dataset.max_len) or raise model.max_len")
        ids = torch.cat([clicks.values(), torch.arange(self.num_items, device=lengths.device)])  # (N + C,)
        both = KeyedJaggedTensor(keys=[self.feature], values=ids,
                                 lengths=torch.cat([lengths, lengths.new_tensor([self.num_items])]), stride=b + 1)
        rows = self.sparse_arch(both)[self.feature].values()  # (N + C, D)
        x, items = rows[:n], rows[n:]  # (N, D), (C, D)
        valid = torch.arange(longest, device=x.device)[None, :] < lengths[:, None]  # (B, L)
        seq = torch.zeros(b, longest, self.dim, dtype=x.dtype, device=x.device)  # (B, L, D)
        seq[valid] = x * math.sqrt(self.dim)
        seq = self.input_dropout(seq + self.positions.weight[:longest])  # (B, L, D)
        causal = torch.triu(torch.ones(longest, longest, dtype=torch.bool, device=x.device), diagonal=1)  # (L, L)
        for block in self.blocks:
            seq = block(seq, src_mask=causal, is_causal=True)  # (B, L, D)
        out = self.final_norm(seq)[valid]  # (N, D)
        return out @ items.t()  # (N, C)
