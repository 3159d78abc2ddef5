"""The server layer: the registry of models, their lifecycle and the request path (`Server`), with what only the
server uses (system shared memory, the metrics config). Frontends and the CLI sit above it; the schedulers,
backends, repository, config and core below."""

from transerve.server.options import ControlMode, ServerOptions
from transerve.server.registry import ModelRecord, ModelState, ModelVersion
from transerve.server.server import Server

__all__ = ["ControlMode", "ModelRecord", "ModelState", "ModelVersion", "Server", "ServerOptions"]
