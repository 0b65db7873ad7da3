"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention) for openinfer.

Read top-down: config.py → weights.py → gated_deltanet.py → state.py → model.py →
kernel_plan.py → plugin.py.
"""
