"""gRPC over HTTP/2 on asyncio, without grpcio: framing and flow control here, RPCs in the shared service.

grpc.aio's per-call machinery costs more than the model work of a small model; this transport parses frames in
an `asyncio.Protocol` on the server's loop and calls the same `InferenceService` methods as the grpc.aio one.
"""
