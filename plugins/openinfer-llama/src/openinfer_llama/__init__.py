"""Llama-architecture models (``LlamaForCausalLM``) for openinfer.

Read top-down: config.py → weights.py → model.py → kernel_plan.py → plugin.py.
"""

from openinfer_llama.config import LlamaConfig
from openinfer_llama.model import LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM"]
