"""Attention backends behind one interface; `get_backend` picks one for a device."""

from engine.attention.base import AttentionBackend, BatchLayout
from engine.attention.selector import get_backend

__all__ = ["AttentionBackend", "BatchLayout", "get_backend"]
