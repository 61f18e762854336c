"""The parameter server: tables, transport, nodes, modes, PS-backed embeddings, Fleet-style API."""

__all__ = []
