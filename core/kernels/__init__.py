"""CUDA kernel sources (package data), compiled at run time by cupy.RawModule."""
