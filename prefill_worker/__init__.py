"""The prefill role: compute prompts, stream their KV layer by layer to a decode worker."""

from prefill_worker.role import PrefillRole

__all__ = ["PrefillRole"]
