"""BST: the Behaviour Sequence Transformer, self-attention over the history and the target together.

Paper: Chen et al., "Behavior Sequence Transformer for E-commerce Recommendation in Alibaba",
DLP-KDD 2019, https://arxiv.org/abs/1905.06874. The user's behaviour sequence and the target
item are one sequence; a Transformer layer (multi-head self-attention, a LeakyReLU feed-forward,
residuals, LayerNorm after each) lets every item attend to every other, the target included;
the outputs of all positions are concatenated with the other features into an MLP
(LeakyReLU; the paper: 1024, 512, 256).

Position: the paper adds a feature pos(v_i) = t(v_t) - t(v_i), the time from each behaviour to
the recommendation; the KJT carries no timestamps, so here position is recency rank instead
(target 0, the latest behaviour 1, the one before 2, ...), a learned embedding added to each
position's vector. Ranks count back from the target, so a row's positions do not depend on
how much padding its batch needs.

Shapes: B rows, L the batch's longest history (<= max_len), D embedding dim, Ft target fields
(e.g. item_id, category), E = Ft*D the model width, S = max_len + 1 sequence slots,
Fo other features, I dense inputs.

    sparse KJT ─► EmbeddingCollection (injected, unpooled) ─┬─ target fields ─► concat ─► t (B, E)
                                                             ├─ history fields (+ flags) ─► h (B, L, E), mask (B, L)
                                                             └─ other features ─► mean of keys ─► others (B, Fo*D)
    slots by recency: [t, h_latest, ..., h_oldest, pad...] (B, S, E) + position[rank] (S, E)
        ─► num_blocks × TransformerEncoderLayer(E, num_heads, LeakyReLU FFN, post-LN), key padding mask
        ─► padded slots set to 0 ─► flatten (B, S*E)
    [others, flattened, dense] (B, Fo*D + S*E + I) ─► LeakyReLU MLP ─► Linear ─► logits (B,)

Padded slots never act as keys (the key padding mask) and their outputs are zeroed before the
MLP, so padding content and the batch's longest row change nothing. Rows with more than
`max_len` history positions are refused: the reader bounds the history (dataset.history_length).

Example:
    >>> import torch
    >>> from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
    >>> _ = torch.manual_seed(0)
    >>> ec = EmbeddingCollection(tables=[           # one table per entity: target and history share rows
    ...     EmbeddingConfig(name="t_item", embedding_dim=4, num_embeddings=50,
    ...                     feature_names=["item_id", "history_item_id"]),
    ...     EmbeddingConfig(name="t_category", embedding_dim=4, num_embeddings=10,
    ...                     feature_names=["category", "history_category"]),
    ...     EmbeddingConfig(name="t_user", embedding_dim=4, num_embeddings=20, feature_names=["user_id"])])
    >>> model = BST(ec, max_len=5, num_heads=2, hidden=(16,)).eval()
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 rows; histories of 3 and 0 items
    ...     keys=["user_id", "item_id", "category", "history_item_id", "history_category"],
    ...     values=torch.tensor([1, 2,  7, 8,  3, 4,  5, 6, 7,  1, 2, 3]),
    ...     lengths=torch.tensor([1, 1,  1, 1,  1, 1,  3, 0,  3, 0]))
    >>> model(torch.zeros(2, 0), kjt).shape
    torch.Size([2])
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models._behaviour import BehaviourFeatures
from models._layers import check_dense

__all__ = ["BST"]


class BST(nn.Module):
    """BST over an injected, unpooled EmbeddingCollection.

    Args:
        embedding_collection: embeds every key (torchrec EmbeddingCollection, recps' local or
            PS-backed one); one dim D for every table.
        dense_in_features: I, dense inputs joined to the MLP's input (0: none).
        target_features, history_features, history_flags, other_features: as in DIN
            (models/_behaviour.py): the candidate's fields, the history's matching fields (oldest
            first), per-position flags added to the item field, the rest mean-pooled.
        max_len: the longest history a row may have (S = max_len + 1 slots with the target).
        num_blocks: Transformer layers (the paper: 1 was best).
        num_heads: attention heads; must divide E = len(target_features) * D (the paper: 8).
        ffn_dim: the feed-forward width (None: 4E).
        hidden: the MLP's layer sizes (the paper: 1024, 512, 256).
        dropout: in the Transformer and after each MLP layer.

    forward(dense (B, I), sparse KJT) -> logits (B,).
    """

    def __init__(
        self,
        embedding_collection: nn.Module,
        dense_in_features: int = 0,
        target_features: Sequence[str] = ("item_id", "category"),
        history_features: Sequence[str] = ("history_item_id", "history_category"),
        history_flags: Sequence[str] = (),
        other_features: Sequence[str] | None = None,
        max_len: int = 20,
        num_blocks: int = 1,
        num_heads: int = 8,
        ffn_dim: int | None = None,
        hidden: Sequence[int] = (1024, 512, 256),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.features = BehaviourFeatures(embedding_collection, "BST", target_features, history_features,
                                          history_flags, other_features)
        e = self.features.width
        if e % num_heads:
            raise ValueError(f"BST: num_heads={num_heads} does not divide the model width {e} "
                             f"(= {len(self.features.target)} target fields x embedding_dim "
                             f"{self.features.dim}); pick a divisor")
        if max_len < 1:
            raise ValueError(f"BST: max_len={max_len}; use 1 or more")
        self.max_len = int(max_len)
        self.dense_in_features = int(dense_in_features)
        self.sparse_arch = embedding_collection
        self.positions = nn.Embedding(self.max_len + 1, e)  # rank 0 = the target
        # small, as BERT's: N(0, 1) rows would swamp the item rows (torchrec draws them ~U(±1/sqrt(rows)))
        nn.init.normal_(self.positions.weight, std=0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(e, num_heads, dim_feedforward=ffn_dim or 4 * e, dropout=dropout,
                                       activation=nn.LeakyReLU(), batch_first=True, norm_first=False)
            for _ in range(num_blocks)
        )
        layers: list[nn.Module] = []
        width = len(self.features.others) * self.features.dim + (self.max_len + 1) * e + self.dense_in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.LeakyReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = size
        layers.append(nn.Linear(width, 1))
        self.over_arch = nn.Sequential(*layers)

    def encode(self, target: torch.Tensor, history: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, S*E): the Transformer's outputs of every slot, padded slots 0, for target (B, E),
        history (B, L, E) oldest first and its mask (B, L) of real positions."""
        b, _, e = history.shape
        lengths = mask.sum(1)  # (B,)
        longest = int(lengths.max()) if b else 0
        if longest > self.max_len:
            raise ValueError(f"BST: a row of {longest} history positions exceeds max_len={self.max_len}; bound "
                             "the history in the reader (dataset.history_length) or raise model.max_len")
        # slot r >= 1 holds the r-th latest behaviour: position lengths - r of the oldest-first history
        rank = torch.arange(1, self.max_len + 1, device=history.device)  # (S-1,)
        source = lengths[:, None] - rank[None, :]  # (B, S-1)
        real = source >= 0  # (B, S-1)
        slots = history.new_zeros(b, self.max_len, e)  # (B, S-1, E)
        slots[real] = history[torch.nonzero(real)[:, 0], source[real]]  # (N, E)
        seq = torch.cat([target.unsqueeze(1), slots], dim=1) + self.positions.weight  # (B, S, E)
        valid = torch.cat([real.new_ones(b, 1), real], dim=1)  # (B, S)
        for block in self.blocks:
            seq = block(seq, src_key_padding_mask=~valid)  # (B, S, E)
        seq = seq * valid.unsqueeze(2).to(seq.dtype)  # (B, S, E): padded slots 0
        return seq.flatten(1)  # (B, S*E)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Logits (B,) of each row's target given its history."""
        check_dense(dense, self.dense_in_features, "BST")
        x = self.features.embed(self.sparse_arch, sparse)
        joined = torch.cat([x.others, self.encode(x.target, x.history, x.mask), dense], dim=1)  # (B, Fo*D + S*E + I)
        return self.over_arch(joined).squeeze(1)  # (B,)
