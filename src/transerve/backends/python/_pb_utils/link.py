"""The worker's link to the server, as model code reaches it: the state the worker sets before it imports the
model (`_channel`, `_model_dir`, `_instance_name`) and the calls that ask the server and wait (model control).

The worker assigns these globals here (not on the `triton_python_backend_utils` facade, which only re-exports);
every part reads them through this module, so there is one copy of each."""

from __future__ import annotations

from typing import Any

from transerve.backends.python._pb_utils.errors import TritonModelException, _require
from transerve.backends.python.channel import Channel
from transerve.backends.python.ipc import OP_MODEL_CONTROL

#: Set by the worker: the folder holding the model file, as Triton's `get_model_dir()` returns.
_model_dir = ""
#: Set by the worker: the name of the model instance it runs (Triton's stub names it in some errors).
_instance_name = ""
#: Set by the worker: its channel to the server.
_channel: Channel | None = None


def _require_channel() -> Channel:
    if _channel is None:
        raise TritonModelException("BLS and response senders work only inside a model served by transerve")
    return _channel


def get_model_dir() -> str:
    return _model_dir


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) a model, as a model-control request would (explicit mode); returns once it is loaded.
    `config` is a JSON model config; `files` maps `file:<version>/<name>` to contents, as in a load request."""
    _require(model_name, str, "load_model", "model_name")
    _require(config, str, "load_model", "config")
    if files is not None and not isinstance(files, dict):
        raise TritonModelException(
            f"failed to load model '{model_name}', files should be a dictionary of file paths and file contents"
        )
    contents = {str(path): bytes(content) for path, content in (files or {}).items()}
    _model_control("load", model_name, config, contents, "Failed to load model")


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload a model (explicit mode); returns once the unload has begun, as Triton's does."""
    _require(model_name, str, "unload_model", "model_name")
    _require(unload_dependents, bool, "unload_model", "unload_dependents")
    _model_control("unload", model_name, unload_dependents, None, "Failed to unload model")


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    _require(model_name, str, "is_model_ready", "model_name")
    _require(model_version, str, "is_model_ready", "model_version")
    if model_version and not (model_version.isdigit() and model_version.isascii()):
        raise TritonModelException(
            "Failed to check model readiness: failed to get model version from specified version string "
            f"'{model_version}', version should be an integral value > 0"
        )
    return bool(_model_control("ready", model_name, model_version, None, "Failed to check model readiness"))


def _model_control(action: str, name: str, argument: Any, files: Any, failure: str) -> Any:
    return _ask_server(OP_MODEL_CONTROL, (action, name, argument, files), failure)


def _ask_server(op: int, body: Any, failure: str) -> Any:
    """Call the server and wait for its answer; its error raises TritonModelException with Triton's wording."""
    channel = _require_channel()
    call_id, call = channel.start_bls(body, [], op)
    channel.wait_until(lambda: bool(call.items))
    channel.finish_bls(call_id)
    (_, error, value), _ = call.items.popleft()
    if error is not None:
        raise TritonModelException(
            f"{failure}: Failed to process the request for model '{_instance_name}', message: {error[1]}"
        )
    return value
