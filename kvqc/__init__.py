"""kvqc: a compiler from declarative KV-cache quantization schemes to Triton kernels."""

__version__ = "0.1.0"
