"""The PyTorch + transformers engine (`engine: "torch"`): `engine.TorchEngine` wires the scheduler (who runs), the
batch runner and model runner (one step's forward pass) and selection (tokens from a step's logits)."""
