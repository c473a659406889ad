"""Model implementations: one Llama-style decoder for every supported family (Llama,
Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE)."""

from engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
