"""KServe v2 over gRPC, through tritonclient (a core dependency): the model's config and `infer`. gRPC has no
`/generate`, so generate mode is HTTP's alone."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from transerve.client.errors import LineFailed, RunStopped
from transerve.client.target import Target


class GrpcTransport:
    def __init__(self, url: str, timeout: float, max_answer_bytes: int) -> None:
        self._url = url.removeprefix("grpc://")
        self._timeout = timeout
        #: tritonclient's own channel options but a bound on what is received.
        self._channel_args = [("grpc.max_send_message_length", 2**31 - 1),
                              ("grpc.max_receive_message_length", max_answer_bytes)]
        self._local = threading.local()

    def model_config(self, model: str, version: str) -> dict[str, Any]:
        return self._call(lambda client: client.get_model_config(model, version, as_json=True,
                                                                 client_timeout=self._timeout),
                          model)["config"]

    def infer(self, target: Target, texts: list[str]) -> list[str]:
        import tritonclient.grpc as grpcclient

        text_input = grpcclient.InferInput(target.input_name, target.shape(len(texts)), "BYTES")
        text_input.set_data_from_numpy(np.array([text.encode("utf-8") for text in texts],
                                                dtype=np.object_).reshape(target.shape(len(texts))))
        result = self._call(lambda client: client.infer(
            target.model, [text_input], model_version=target.version,
            outputs=[grpcclient.InferRequestedOutput(target.output_name)], parameters=target.parameters or None,
            client_timeout=self._timeout))
        return target.answers(result.as_numpy(target.output_name), len(texts))

    def _call(self, call: Any, model: str | None = None) -> Any:
        """`call` on this thread's client. Errors of an infer call (`model` None) that are INVALID_ARGUMENT are the
        line's; any other stops the run."""
        from tritonclient.utils import InferenceServerException

        client = getattr(self._local, "client", None)
        if client is None:
            import tritonclient.grpc as grpcclient

            client = self._local.client = grpcclient.InferenceServerClient(
                self._url, channel_args=self._channel_args)
        try:
            return call(client)
        except InferenceServerException as exc:
            if model is None and exc.status() == "StatusCode.INVALID_ARGUMENT":
                raise LineFailed(f"INVALID_ARGUMENT: {exc.message()}") from None
            about = f"model '{model}': " if model is not None else ""
            status = (exc.status() or "error").removeprefix("StatusCode.")
            raise RunStopped(f"{about}{status}: {exc.message()}") from None
