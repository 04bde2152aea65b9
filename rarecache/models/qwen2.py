"""Qwen2 / Qwen2.5: the Llama decoder with biases on q, k and v (set by the config)."""

from .llama import CausalLM


class Qwen2ForCausalLM(CausalLM):
    pass
