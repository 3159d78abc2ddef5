"""Triton's onnxruntime backend: ONNX models in onnxruntime sessions."""
