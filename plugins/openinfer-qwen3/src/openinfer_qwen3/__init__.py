"""Qwen3 dense models (``Qwen3ForCausalLM``) for openinfer.

Read top-down: config.py → weights.py → model.py → kernel_plan.py → plugin.py.
"""
