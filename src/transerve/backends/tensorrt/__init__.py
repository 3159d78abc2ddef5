"""Triton's tensorrt backend: serialized TensorRT engines (`model.plan`) on NVIDIA GPUs."""
