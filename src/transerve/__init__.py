"""transerve: a Triton-compatible inference server for transformer models."""

__version__ = "0.1.0"
