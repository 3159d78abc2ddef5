"""Model configuration: config.pbtxt into Triton's own ModelConfig message, normalised and validated."""
