"""CUDA backend: CuPy + our kernels + cuBLAS (bf16). Imported only when a GPU is used."""
