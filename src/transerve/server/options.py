"""What `transerve serve` asks of the server: its model control mode and settings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from transerve.config.model_config import MAX_CONFIG_BYTES
from transerve.core.errors import invalid_arg
from transerve.core.log_settings import LogSettings
from transerve.core.tracing import TraceOptions
from transerve.repository.overrides import MAX_LOAD_BYTES, MAX_LOAD_FILES
from transerve.repository.storage_url import StorageUrl, is_storage_url, parse_storage_url
from transerve.server.metrics_config import MetricsConfig
from transerve.server.shared_memory import MAX_REGIONS, MAX_REGIONS_PER_OBJECT


def parse_repository(text: str) -> Path | StorageUrl:
    """A `--model-repository` value: a folder, or a repository on object storage (StorageUrlError, a ValueError,
    for a URL that names no bucket)."""
    return parse_storage_url(text) if is_storage_url(text) else Path(text)


class ControlMode(enum.Enum):
    NONE = "none"
    POLL = "poll"
    EXPLICIT = "explicit"


@dataclass(slots=True, frozen=True)
class InputLimits:
    """What a client may make the server hold or parse beyond a request body (docs/security.md, the flags)."""

    #: `--model-config-max-bytes`: a load request's `config` override, and a `config.pbtxt`.
    config_bytes: int = MAX_CONFIG_BYTES
    #: `--model-load-max-files` and `--model-load-max-bytes`: a load request's `file:` contents.
    load_files: int = MAX_LOAD_FILES
    load_bytes: int = MAX_LOAD_BYTES
    #: `--max-shared-memory-regions` and `--max-shared-memory-regions-per-object`.
    shm_regions: int = MAX_REGIONS
    shm_regions_per_object: int = MAX_REGIONS_PER_OBJECT

    def check_load(self, model_name: str, config_bytes: int, files: int, file_bytes: int) -> None:
        """Refuse a load request past the bounds, before its contents are decoded, written or parsed."""
        where = f"failed to load '{model_name}'"
        if config_bytes > self.config_bytes:
            raise invalid_arg(f"{where}: the 'config' parameter is {config_bytes} bytes long, more than the "
                              f"{self.config_bytes} allowed (--model-config-max-bytes)")
        if files > self.load_files:
            raise invalid_arg(f"{where}: {files} 'file:' parameters, more than the {self.load_files} allowed "
                              "(--model-load-max-files)")
        if file_bytes > self.load_bytes:
            raise invalid_arg(f"{where}: the 'file:' contents are {file_bytes} bytes, more than the "
                              f"{self.load_bytes} allowed (--model-load-max-bytes)")


@dataclass(slots=True)
class ServerOptions:
    """What `transerve serve` was asked to do."""

    repositories: list[Path]
    control_mode: ControlMode = ControlMode.NONE
    load_models: list[str] = field(default_factory=list)
    strict_readiness: bool = True
    exit_timeout_secs: float = 30.0
    #: `--model-load-retry-count`: how many times a load that failed is tried again (Triton's flag).
    load_retries: int = 0
    auto_complete: bool = True
    poll_secs: float = 15.0
    backend_configs: dict[str, dict[str, str]] = field(default_factory=dict)
    #: The response cache's size in bytes (`--cache-config local,size=N`); None: no cache.
    cache_bytes: int | None = None
    #: The `--log-*` flags: the logging extension's settings at start.
    log_settings: LogSettings = field(default_factory=LogSettings)
    #: `--metrics-config`: which latency metrics the models keep (summaries are observed as requests finish).
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    #: The `--trace-*` flags: the trace extension's settings at start.
    trace: TraceOptions = field(default_factory=TraceOptions)
    #: `--model-repository` values on object storage (`s3://`, `gs://`, `as://`, `az://`).
    remote_repositories: list[StorageUrl] = field(default_factory=list)
    #: `--model-repository-cache`: the folder under which this server mirrors them (None: the system's temp dir).
    repository_cache: Path | None = None
    #: `--model-repository-max-model-bytes`: the most one model may download.
    max_model_bytes: int = 32 << 30
    #: `--max-response-bytes`: the most one response's outputs may hold (1 GiB: under gRPC's 2 GiB messages).
    max_response_bytes: int = 1 << 30
    #: The bounds on load requests, configs and shared memory registrations.
    limits: InputLimits = field(default_factory=InputLimits)
