"""Triton's pytorch (libtorch) backend: TorchScript models."""
