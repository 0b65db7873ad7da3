"""openinfer: an LLM inference engine in Python (NumPy and CUDA backends, model plugins).

The public API a plugin or an application uses is what this module exports.
"""
