"""Model implementations (one: the Llama family)."""

from engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
