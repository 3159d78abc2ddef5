"""Triton's gRPC frontend: `inference.GRPCInferenceService` and `grpc.health.v1.Health`."""
