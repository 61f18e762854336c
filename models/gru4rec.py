"""GRU4Rec: session-based recommendation with a recurrent network.

Paper: Hidasi, Karatzoglou, Baltrunas, Tikk, "Session-based Recommendations with Recurrent
Neural Networks", ICLR 2016 (https://arxiv.org/abs/1511.06939); BPR-max and the
constrained (tied) item embedding: Hidasi & Karatzoglou, "Recurrent Neural Networks with
Top-k Gains for Session-based Recommendations", CIKM 2018 (https://arxiv.org/abs/1706.03847).

Shapes: B rows (sessions or session-parallel lanes), L their longest length, N = the
positions of the batch (sum of row lengths), D embedding dim = GRU width, Y GRU layers,
C items.

One item table serves input and output (GRU4Rec's `constrained_embedding`): the injected
collection embeds the clicks and also yields every item's row, so a score is the dot
product of the GRU output with the item's embedding; scoring all C items per position is
a (N, D) x (D, C) product. Both lookups go through the collection in one call, so a
parameter-server collection pulls and pushes the table once per step.

    sparse KJT (B rows, jagged item ids) ┐
    all item ids 0..C-1 ─────────────────┴─► EmbeddingCollection (injected) ─► clicks (N, D), items (C, D)
                                                     │                                        │
    clicks ─► pad (B, L, D) ─► dropout ─► GRU (Y layers, width D, state h0 (B, Y, D)) ─► (B, L, D)
                                                     │                                        │
                     valid positions (N, D) ─► dropout ─► x items^T ─────────────────► scores (N, C)
                     state after the last click of each row ─────────────────────────► hidden (B, Y, D)

Training uses GRU4Rec's session-parallel mini-batches (rows of length 1 and a carried
`hidden`; recps.data.sessions.SessionParallelSource, recps.tasks.NextItemTask); whole
sessions (rows of any length, `hidden=None`) give the same scores as feeding their clicks
one at a time, which is how evaluation reads every prefix of a session in one call.

Example:
    >>> import torch
    >>> from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
    >>> _ = torch.manual_seed(0)
    >>> ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t_item", embedding_dim=8, num_embeddings=20,
    ...                                                  feature_names=["item"])])
    >>> model = GRU4Rec(ec).eval()
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["item"], torch.tensor([4, 7, 1, 9, 9]), torch.tensor([3, 2]))
    >>> scores, hidden = model(kjt)
    >>> scores.shape, hidden.shape                  # 5 positions x 20 items; 2 rows x 1 layer x 8
    (torch.Size([5, 20]), torch.Size([2, 1, 8]))
    >>> def step(a, b): return KeyedJaggedTensor.from_lengths_sync(["item"], torch.tensor([a, b]), torch.tensor([1, 1]))
    >>> _, h1 = model(step(4, 9))                   # session-parallel: the first clicks of both rows...
    >>> s2, _ = model(step(7, 9), h1)               # ...then the second ones, the state carried
    >>> torch.allclose(s2, scores[[1, 4]], atol=1e-5)
    True
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._layers import collection_layout

__all__ = ["GRU4Rec"]


class GRU4Rec(nn.Module):
    """GRU4Rec over an injected item EmbeddingCollection (one feature, tied input/output rows).

    Args:
        embedding_collection: torchrec EmbeddingCollection or recps' local / PS-backed one
            with exactly one feature (the clicked item); its table's num_embeddings is C and
            its ids must be 0..C-1.
        num_layers: Y, stacked GRU layers (each of width D).
        dropout_embed: dropout on the click embeddings (GRU4Rec's dropout_p_embed).
        dropout_hidden: dropout on the GRU output before scoring and between layers
            (GRU4Rec's dropout_p_hidden).

    forward(sparse, hidden=None) -> (scores (N, C), hidden (B, Y, D)); `hidden` is the
    state before each row's first click (zeros when None), batch-first.
    """

    def __init__(self, embedding_collection: nn.Module, num_layers: int = 1, dropout_embed: float = 0.0,
                 dropout_hidden: float = 0.0) -> None:
        super().__init__()
        names, dim = collection_layout(embedding_collection, "GRU4Rec")
        if len(names) != 1:
            raise ValueError(f"GRU4Rec: the collection serves features {names}; it needs exactly one, the clicked "
                             "item (its table scores every item)")
        if num_layers < 1:
            raise ValueError(f"GRU4Rec: num_layers={num_layers}; use 1 or more")
        self.feature = names[0]
        self.num_items = int(embedding_collection.embedding_configs()[0].num_embeddings)
        self.dim = dim
        self.num_layers = int(num_layers)
        self.sparse_arch = embedding_collection
        self.embed_dropout = nn.Dropout(dropout_embed)
        self.gru = nn.GRU(dim, dim, num_layers=self.num_layers, batch_first=True,
                          dropout=dropout_hidden if num_layers > 1 else 0.0)
        self.out_dropout = nn.Dropout(dropout_hidden)

    def forward(self, sparse: KeyedJaggedTensor,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores (N, C) of every item after each click, and the state (B, Y, D) after each row."""
        clicks = sparse[self.feature]
        lengths = clicks.lengths()  # (B,)
        b, n = lengths.numel(), clicks.values().numel()
        ids = torch.cat([clicks.values(), torch.arange(self.num_items, device=lengths.device)])  # (N + C,)
        both = KeyedJaggedTensor(keys=[self.feature], values=ids,
                                 lengths=torch.cat([lengths, lengths.new_tensor([self.num_items])]), stride=b + 1)
        rows = self.sparse_arch(both)[self.feature].values()  # (N + C, D)
        x, items = rows[:n], rows[n:]  # (N, D), (C, D)
        if hidden is None:
            hidden = x.new_zeros(b, self.num_layers, self.dim)  # (B, Y, D)
        h0 = hidden.transpose(0, 1).contiguous()  # (Y, B, D), torch's layout
        longest = int(lengths.max()) if b else 0
        if b and int(lengths.min()) == longest:  # session-parallel steps: every row has the same length
            out, h_n = self.gru(self.embed_dropout(x).view(b, longest, self.dim), h0)  # (B, L, D), (Y, B, D)
            out = out.reshape(n, self.dim)  # (N, D)
        else:
            padded = torch.zeros(b, longest, self.dim, dtype=x.dtype, device=x.device)  # (B, L, D)
            valid = torch.arange(longest, device=x.device)[None, :] < lengths[:, None]  # (B, L)
            padded[valid] = self.embed_dropout(x)
            packed = nn.utils.rnn.pack_padded_sequence(padded, lengths.cpu(), batch_first=True, enforce_sorted=False)
            out_packed, h_n = self.gru(packed, h0)  # h_n: the state after each row's last click
            out, _ = nn.utils.rnn.pad_packed_sequence(out_packed, batch_first=True, total_length=longest)  # (B, L, D)
            out = out[valid]  # (N, D)
        scores = self.out_dropout(out) @ items.t()  # (N, C)
        return scores, h_n.transpose(0, 1)  # (N, C), (B, Y, D)
