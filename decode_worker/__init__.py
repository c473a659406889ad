"""The decode role: reserve blocks, receive KV, decode in a continuous batch, stream tokens."""

from decode_worker.role import DecodeRole

__all__ = ["DecodeRole"]
