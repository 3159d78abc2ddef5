"""`transerve serve`: tritonserver's flags, in both `--flag=value` and `--flag value` forms; and the model tools
(`export`, `convert`), the load tool (`perf`) and the file client (`client`) as subcommands."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import resource
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from transerve import __version__
from transerve.client import command as client_command
from transerve.convert import command as convert_command
from transerve.core.allocator import keep_large_buffers
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.log_settings import FORMATS, LogSettings
from transerve.core.tracing import TraceConfigError, parse_trace_options
from transerve.export import command as export_command
from transerve.frontends.access import GROUPS, GRPC_HEADER_PREFIX, HeaderForwarding, OptionError, Restrictions
from transerve.frontends.frontend import Frontend
from transerve.frontends.grpc.limits import MAX_MESSAGE_BYTES, Http2Limits
from transerve.frontends.http.protocol import HttpLimits
from transerve.frontends.listeners import AccessOptions, Address, FrontendOptions, build_listeners
from transerve.frontends.tls import TlsError, TlsOptions
from transerve.perf import command as perf_command
from transerve.ray import command as ray_command
from transerve.scheduling.response_cache import parse_cache_config
from transerve.server import ControlMode, Server, ServerOptions
from transerve.server.metrics_config import parse_metrics_config
from transerve.server.options import InputLimits, StorageUrl, parse_repository

log = logging.getLogger("transerve")


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got '{text}'")
    return value


def _repository(text: str) -> Path | StorageUrl:
    try:
        return parse_repository(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _backend_config(text: str) -> tuple[str, str, str]:
    backend, _, setting = text.partition(",")
    key, equals, value = setting.partition("=")
    if not backend or not key or not equals:
        raise argparse.ArgumentTypeError(f"expected <backend>,<key>=<value>, got '{text}'")
    return backend, key, value


class _GrpcSslMutual(argparse.Action):
    """`--grpc-use-ssl-mutual`: as in tritonserver, any value, false included, also sets `--grpc-use-ssl` (which a
    later `--grpc-use-ssl=false` turns off again)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.grpc_use_ssl = True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="transerve", description="A Triton-compatible inference server.")
    parser.add_argument("--version", action="version", version=f"transerve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve one or more Triton model repositories",
                                allow_abbrev=False)
    add = serve.add_argument
    add("--model-repository", "--model-store", dest="model_repository", action="append", required=True,
        type=_repository, metavar="PATH",
        help="a model repository folder, or s3://, gs://, as:// (az://) object storage (repeatable)")
    add("--model-repository-cache", type=Path, metavar="DIR",
        help="the folder under which object-storage models are downloaded (default: the temp dir); each server "
             "makes its own folder there and removes it at exit")
    add("--model-repository-max-model-bytes", type=int, default=32 << 30, metavar="N",
        help="the most one model may download from object storage (default 32 GiB)")
    add("--max-response-bytes", type=int, default=1 << 30, metavar="BYTES",
        help="most bytes one response's outputs may hold; a larger response fails with a 400 (default 1 GiB)")
    limits = InputLimits()
    add("--model-config-max-bytes", type=int, default=limits.config_bytes, metavar="BYTES",
        help=f"longest config a load request or a config.pbtxt may hold (default {limits.config_bytes})")
    add("--model-load-max-files", type=int, default=limits.load_files, metavar="N",
        help=f"most 'file:' parameters in one load request (default {limits.load_files})")
    add("--model-load-max-bytes", type=int, default=limits.load_bytes, metavar="BYTES",
        help=f"most bytes of 'file:' contents in one load request (default {limits.load_bytes})")
    add("--max-shared-memory-regions", type=int, default=limits.shm_regions, metavar="N",
        help=f"most system shared memory regions registered at once (default {limits.shm_regions})")
    add("--max-shared-memory-regions-per-object", type=int, default=limits.shm_regions_per_object, metavar="N",
        help=f"most regions registered on one shared memory object (default {limits.shm_regions_per_object})")
    add("--http-address", default="0.0.0.0")
    add("--http-port", type=int, default=8000)
    add("--grpc-address", default="0.0.0.0")
    add("--grpc-port", type=int, default=8001)
    add("--grpc-transport", choices=["native", "grpcio"], default="native",
        help="gRPC server: transerve's own HTTP/2 (native, cheaper per call) or grpcio's grpc.aio")
    add("--grpc-max-input-size", type=int, default=MAX_MESSAGE_BYTES, metavar="BYTES",
        help="largest gRPC request message (default 2147483647, as Triton; RESOURCE_EXHAUSTED past it)")
    add("--grpc-http2-max-ping-strikes", type=int, default=2, metavar="N",
        help="PINGs sooner than --grpc-http2-min-recv-ping-interval-without-data tolerated before the connection "
             "ends with GOAWAY ENHANCE_YOUR_CALM (0: any number; default 2)")
    add("--grpc-http2-min-recv-ping-interval-without-data", type=int, default=300000, metavar="MS",
        help="the shortest interval between a client's PINGs while the server sends nothing (default 300000)")
    add("--grpc-keepalive-permit-without-calls", type=_bool, default=False, metavar="BOOL",
        help="let clients ping that often with no call open too (default false: every two hours)")
    add("--grpc-handshake-timeout-secs", type=float, default=10.0, metavar="SECONDS",
        help="time a gRPC connection has for its preface and SETTINGS (default 10)")
    add("--grpc-idle-timeout-secs", type=float, default=300.0, metavar="SECONDS",
        help="close a gRPC connection with no call open for this long (GOAWAY, default 300)")
    add("--grpc-stall-timeout-secs", type=float, default=30.0, metavar="SECONDS",
        help="give up an answer that waits this long for a client that does not read it (default 30)")
    add("--grpc-use-ssl", type=_bool, default=False, metavar="BOOL", help="serve gRPC over TLS")
    add("--grpc-use-ssl-mutual", type=_bool, default=False, metavar="BOOL", action=_GrpcSslMutual,
        help="with true, require client certificates signed by --grpc-root-cert; as in tritonserver, any value "
             "turns on --grpc-use-ssl")
    add("--grpc-server-cert", metavar="PEM", help="the server's certificate chain, with --grpc-use-ssl")
    add("--grpc-server-key", metavar="PEM", help="the server's private key (unencrypted), with --grpc-use-ssl")
    add("--grpc-root-cert", metavar="PEM", help="the CA that client certificates must be signed by, with "
        "--grpc-use-ssl-mutual")
    add("--http-use-ssl", type=_bool, default=False, metavar="BOOL", help="serve HTTPS instead of HTTP")
    add("--http-use-ssl-mutual", type=_bool, default=False, metavar="BOOL",
        help="serve HTTPS to clients with a certificate signed by --http-root-cert only (implies --http-use-ssl)")
    add("--http-server-cert", metavar="PEM", help="the server's certificate chain, with --http-use-ssl")
    add("--http-server-key", metavar="PEM", help="the server's private key (unencrypted), with --http-use-ssl")
    add("--http-root-cert", metavar="PEM", help="the CA that client certificates must be signed by, with "
        "--http-use-ssl-mutual")
    add("--http-restricted-api", action="append", default=[], metavar="API[,API...]:KEY=VALUE",
        help="answer these API groups only to requests with header KEY: VALUE (403 otherwise); groups: "
             + ", ".join(GROUPS))
    add("--grpc-restricted-protocol", action="append", default=[], metavar="PROTOCOL[,PROTOCOL...]:KEY=VALUE",
        help="answer these gRPC groups only to calls with metadata triton-grpc-protocol-KEY: VALUE (UNAVAILABLE "
             "otherwise)")
    add("--http-header-forward-pattern", metavar="REGEX",
        help="HTTP headers whose names match (RE2 syntax, case-insensitive) become inference request parameters")
    add("--grpc-header-forward-pattern", metavar="REGEX",
        help="gRPC metadata whose names match (RE2 syntax, case-insensitive) become inference request parameters")
    add("--trust-request-chat-template", type=_bool, nargs="?", const=True, default=False, metavar="BOOL",
        help="let /v1/chat/completions and /tokenize requests send their own Jinja 'chat_template' (vLLM's flag): "
             "the server runs it, sandboxed and bounded; refused with a 400 otherwise (default false)")
    add("--metrics-address", default="0.0.0.0")
    add("--metrics-port", type=int, default=8002)
    add("--metrics-interval-ms", type=float, default=2000.0, metavar="MS",
        help="how often CPU and GPU metrics are read (default 2000)")
    add("--metrics-config", action="append", default=[], metavar="SETTING=VALUE",
        help="counter_latencies=false, summary_latencies=true, summary_quantiles=<q>:<error>,... (repeatable)")
    add("--allow-metrics", type=_bool, default=True, metavar="BOOL", help="serve Prometheus metrics on /metrics")
    add("--allow-cpu-metrics", type=_bool, default=True, metavar="BOOL")
    add("--allow-gpu-metrics", type=_bool, default=True, metavar="BOOL")
    add("--allow-http", type=_bool, default=True, metavar="BOOL")
    add("--allow-grpc", type=_bool, default=True, metavar="BOOL")
    add("--model-control-mode", choices=[mode.value for mode in ControlMode], default="none")
    add("--load-model", action="append", default=[], metavar="NAME",
        help="with explicit control: a model to load at start (repeatable, '*' for all)")
    add("--repository-poll-secs", type=float, default=15.0)
    add("--strict-readiness", type=_bool, default=True, metavar="BOOL")
    add("--exit-on-error", type=_bool, default=None, metavar="BOOL",
        help="true: exit if a model fails to load at start; false: serve on even when the start fails (a "
             "repository missing or unreadable: not live, not ready). Unset: a failed model is listed UNAVAILABLE, "
             "a failed start exits")
    add("--model-load-retry-count", type=_non_negative, default=0, metavar="N",
        help="try a model load that failed N more times before it counts as failed (default 0)")
    add("--exit-timeout-secs", type=float, default=30.0,
        help="on SIGTERM/SIGINT, and for an unload: how long running requests may go on before they are stopped "
             "(python workers killed, their requests answered UNAVAILABLE)")
    add("--log-verbose", type=int, default=0, metavar="LEVEL")
    add("--log-info", type=_bool, default=True, metavar="BOOL")
    add("--log-warning", type=_bool, default=True, metavar="BOOL")
    add("--log-error", type=_bool, default=True, metavar="BOOL")
    add("--log-format", choices=list(FORMATS), default="default")
    add("--log-file", default="", metavar="PATH", help="write the server's log there instead of to stderr")
    add("--disable-auto-complete-config", action="store_true")
    add("--strict-model-config", type=_bool, default=None, metavar="BOOL",
        help="the older name of --disable-auto-complete-config")
    add("--backend-config", type=_backend_config, action="append", default=[], metavar="BACKEND,KEY=VALUE")
    add("--http-max-input-size", type=int, default=64 * 1024 * 1024, metavar="BYTES")
    _add_http_limits(add)
    add("--cache-config", action="append", default=[], metavar="local,size=BYTES",
        help="a response cache of BYTES for the models whose config enables response_cache")
    add("--cache-directory", metavar="PATH", help="accepted for tritonserver's command lines; transerve's cache "
        "is built in")
    add("--trace-config", action="append", default=[], metavar="[MODE,]SETTING=VALUE",
        help="request tracing, as tritonserver's: level=TIMESTAMPS|TENSORS|OFF, rate=N, count=N, mode=triton|"
             "opentelemetry; triton,file=PATH, triton,log-frequency=N; opentelemetry,url=URL, "
             "opentelemetry,resource=KEY=VALUE, opentelemetry,bsp_*=N (repeatable)")
    add("--trace-file", help="deprecated: --trace-config triton,file=PATH")
    add("--trace-level", action="append", help="deprecated: --trace-config level=LEVEL")
    add("--trace-rate", help="deprecated: --trace-config rate=N")
    add("--trace-count", help="deprecated: --trace-config count=N")
    add("--trace-log-frequency", help="deprecated: --trace-config triton,log-frequency=N")
    export_command.add_parser(commands)
    convert_command.add_parser(commands)
    perf_command.add_parser(commands)
    client_command.add_parser(commands)
    ray_command.add_parser(commands)
    return parser


def _add_http_limits(add: Any) -> None:
    """transerve's own flags (Triton has none) for what an HTTP client may hold; docs/security.md explains them."""
    default = HttpLimits()
    add("--http-max-url-size", type=int, default=default.max_url, metavar="BYTES",
        help=f"longest request target, its query included (414 past it; default {default.max_url})")
    add("--http-max-header-size", type=int, default=default.max_header_size, metavar="BYTES",
        help=f"most bytes of header names and values in a request (431 past it; default {default.max_header_size})")
    add("--http-max-headers", type=int, default=default.max_headers, metavar="N",
        help=f"most header fields in a request (431 past it; default {default.max_headers})")
    add("--http-header-timeout-secs", type=float, default=default.header_timeout, metavar="SECONDS",
        help="time for a request's head to arrive from its first byte, and for a new connection's first request "
             f"to begin (408 past it; 0 for none; default {default.header_timeout:g})")
    add("--http-max-generate-size", type=int, default=default.max_generate_size, metavar="BYTES",
        help="largest /generate and /generate_stream body, which is JSON read on the event loop (413 past it; "
             f"default {default.max_generate_size})")
    add("--http-body-timeout-secs", type=float, default=default.body_timeout, metavar="SECONDS",
        help=f"longest wait for the next bytes of a request body (408 past it; 0 for none; default "
             f"{default.body_timeout:g})")
    add("--http-keepalive-timeout-secs", type=float, default=default.keepalive_timeout, metavar="SECONDS",
        help=f"how long an idle connection stays open (0 for ever; default {default.keepalive_timeout:g})")
    add("--http-send-timeout-secs", type=float, default=default.send_timeout, metavar="SECONDS",
        help="how long a client may leave its answers unread before its connection is cut (0 for ever; default "
             f"{default.send_timeout:g})")
    add("--http-max-connections", type=int, default=default.max_connections, metavar="N",
        help=f"most open HTTP connections; past it a new one is answered 503 and closed (default "
             f"{default.max_connections}, at most half the process's open-file limit)")


def http_limits_from_args(args: argparse.Namespace, file_limit: int) -> HttpLimits:
    """The HTTP limits of the command line; the connection cap stays within half of `file_limit` (the other half
    is for gRPC, model files and worker sockets), so that clients past it get a 503 rather than nothing."""
    connections = args.http_max_connections
    if connections > file_limit // 2:
        log.warning("--http-max-connections lowered from %d to %d: the process may open %d files",
                    connections, file_limit // 2, file_limit)
        connections = file_limit // 2
    for name in ("http_max_url_size", "http_max_header_size", "http_max_headers", "http_max_connections"):
        if getattr(args, name) < 1:
            raise SystemExit(f"transerve serve: --{name.replace('_', '-')} must be at least 1")
    for name in ("http_header_timeout_secs", "http_body_timeout_secs", "http_keepalive_timeout_secs",
                 "http_send_timeout_secs"):
        if getattr(args, name) < 0:
            raise SystemExit(f"transerve serve: --{name.replace('_', '-')} must not be negative")
    return HttpLimits(
        max_url=args.http_max_url_size, max_header_size=args.http_max_header_size, max_headers=args.http_max_headers,
        header_timeout=args.http_header_timeout_secs, body_timeout=args.http_body_timeout_secs,
        keepalive_timeout=args.http_keepalive_timeout_secs, send_timeout=args.http_send_timeout_secs,
        max_connections=connections, max_generate_size=args.http_max_generate_size,
    )


def raise_file_limit() -> int:
    """Raise the soft limit on open files to the hard one, as Go's runtime does, and return it: every connection is
    a file, and a soft limit of 1024 (a common default) would leave clients unanswered long before any cap."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft
    return hard


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    backend_configs: dict[str, dict[str, str]] = {}
    for backend, key, value in args.backend_config:
        backend_configs.setdefault(backend, {})[key] = value
    auto_complete = not args.disable_auto_complete_config and not args.strict_model_config
    try:
        cache_bytes = parse_cache_config(args.cache_config)
    except ServerError as exc:
        raise SystemExit(f"transerve serve: {exc.message}") from None
    try:
        metrics = parse_metrics_config(args.metrics_config)
    except ValueError as exc:
        raise SystemExit(f"transerve serve: {exc}") from None
    try:
        trace = parse_trace_options(args.trace_config, args.trace_file, args.trace_level, args.trace_rate,
                                    args.trace_count, args.trace_log_frequency)
    except TraceConfigError as exc:
        raise SystemExit(f"transerve serve: {exc}") from None
    return ServerOptions(
        repositories=[path for path in args.model_repository if isinstance(path, Path)],
        remote_repositories=[url for url in args.model_repository if isinstance(url, StorageUrl)],
        repository_cache=args.model_repository_cache,
        max_model_bytes=args.model_repository_max_model_bytes,
        limits=input_limits_from_args(args),
        control_mode=ControlMode(args.model_control_mode),
        load_models=args.load_model,
        strict_readiness=args.strict_readiness,
        exit_timeout_secs=args.exit_timeout_secs,
        load_retries=args.model_load_retry_count,
        auto_complete=auto_complete,
        poll_secs=args.repository_poll_secs,
        backend_configs=backend_configs,
        cache_bytes=cache_bytes,
        metrics=metrics,
        log_settings=LogSettings(log_file=args.log_file, log_info=args.log_info, log_warning=args.log_warning,
                                 log_error=args.log_error, log_verbose_level=args.log_verbose,
                                 log_format=args.log_format),
        trace=trace,
        max_response_bytes=_positive(args, "max_response_bytes"),
    )


def _positive(args: argparse.Namespace, flag: str) -> int:
    """A flag's value; SystemExit unless it is positive."""
    if getattr(args, flag) <= 0:
        raise SystemExit(f"transerve serve: --{flag.replace('_', '-')} must be positive")
    return getattr(args, flag)


def input_limits_from_args(args: argparse.Namespace) -> InputLimits:
    """SystemExit for a bound that is not positive."""
    flags = ("model_config_max_bytes", "model_load_max_files", "model_load_max_bytes", "max_shared_memory_regions",
             "max_shared_memory_regions_per_object")
    for flag in flags:
        if getattr(args, flag) <= 0:
            raise SystemExit(f"transerve serve: --{flag.replace('_', '-')} must be positive")
    return InputLimits(*(getattr(args, flag) for flag in flags))


def grpc_limits_from_args(args: argparse.Namespace) -> Http2Limits:
    """SystemExit for a value no limit can have."""
    for flag in ("grpc_max_input_size", "grpc_handshake_timeout_secs", "grpc_idle_timeout_secs",
                 "grpc_stall_timeout_secs"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"transerve serve: --{flag.replace('_', '-')} must be positive")
    if args.grpc_http2_max_ping_strikes < 0 or args.grpc_http2_min_recv_ping_interval_without_data < 0:
        raise SystemExit("transerve serve: the gRPC ping policy takes numbers of 0 or more")
    return Http2Limits(
        max_message=args.grpc_max_input_size,
        handshake_timeout=args.grpc_handshake_timeout_secs,
        idle_timeout=args.grpc_idle_timeout_secs,
        stall_timeout=args.grpc_stall_timeout_secs,
        max_ping_strikes=args.grpc_http2_max_ping_strikes,
        min_ping_interval=args.grpc_http2_min_recv_ping_interval_without_data / 1000,
        pings_without_calls=args.grpc_keepalive_permit_without_calls,
    )


def access_from_args(args: argparse.Namespace) -> AccessOptions:
    """SystemExit with tritonserver's message for a flag it would refuse."""
    try:
        return AccessOptions(
            Restrictions.parse(args.http_restricted_api, "http-restricted-api", "api"),
            Restrictions.parse(args.grpc_restricted_protocol, "grpc-restricted-protocol", "protocol",
                               GRPC_HEADER_PREFIX),
            _forwarding(args.http_header_forward_pattern, "http-header-forward-pattern"),
            _forwarding(args.grpc_header_forward_pattern, "grpc-header-forward-pattern"),
            # Only a served protocol's files are read: tritonserver reads none while its service is off.
            TlsOptions.from_flags("http", args.http_use_ssl or args.http_use_ssl_mutual, args.http_use_ssl_mutual,
                                  args.http_server_cert, args.http_server_key, args.http_root_cert)
            if args.allow_http else None,
            TlsOptions.from_flags("grpc", args.grpc_use_ssl, args.grpc_use_ssl_mutual, args.grpc_server_cert,
                                  args.grpc_server_key, args.grpc_root_cert)
            if args.allow_grpc else None,
        )
    except (OptionError, TlsError) as exc:
        raise SystemExit(f"transerve serve: {exc}") from None


def _forwarding(pattern: str | None, option: str) -> HeaderForwarding | None:
    return HeaderForwarding(pattern, option) if pattern else None


def warn_open_model_control(args: argparse.Namespace, access: AccessOptions) -> None:
    """Warn when explicit model control is reachable from other machines without a restriction: whoever reaches the
    port can then load models, and a load with `file:` contents is code the server runs (as in Triton)."""
    if args.model_control_mode != ControlMode.EXPLICIT.value:
        return
    services = (("HTTP", args.allow_http, args.http_address, access.http_restrictions, "--http-restricted-api"),
                ("GRPC", args.allow_grpc, args.grpc_address, access.grpc_restrictions, "--grpc-restricted-protocol"))
    for name, enabled, address, restrictions, flag in services:
        if enabled and not _loopback(address) and "model-repository" not in restrictions.required:
            log.warning("explicit model control is served over %s on %s without a restriction: anyone who reaches "
                        "it can load models, and a load with 'file:' contents runs the code it uploads; restrict "
                        "it with %s=model-repository:KEY=VALUE or listen on 127.0.0.1 (see docs/security.md)",
                        name, address, flag)


def _loopback(address: str) -> bool:
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to anything
        return False


def frontend_options_from_args(args: argparse.Namespace, access: AccessOptions, file_limit: int) -> FrontendOptions:
    """The services the flags turn on, where they listen and their limits (SystemExit for a bad limit)."""
    return FrontendOptions(
        access=access,
        grpc=Address(args.grpc_address, args.grpc_port) if args.allow_grpc else None,
        grpc_transport=args.grpc_transport,
        grpc_limits=grpc_limits_from_args(args),
        http=Address(args.http_address, args.http_port) if args.allow_http else None,
        http_max_input_size=args.http_max_input_size,
        http_limits=http_limits_from_args(args, file_limit),
        metrics=Address(args.metrics_address, args.metrics_port) if args.allow_metrics else None,
        cpu_metrics=args.allow_cpu_metrics,
        gpu_metrics=args.allow_gpu_metrics,
        metrics_interval_ms=args.metrics_interval_ms,
        trust_request_chat_template=args.trust_request_chat_template,
    )


async def serve(args: argparse.Namespace, access: AccessOptions) -> int:
    """Load the models, serve until SIGINT/SIGTERM, then drain and unload."""
    missing = [path for path in args.model_repository if isinstance(path, Path) and not path.is_dir()]
    for path in missing:
        log.error("model repository '%s' is not a folder", path)
    if missing and args.exit_on_error is not False:
        return 1
    if args.model_repository_cache is not None and not args.model_repository_cache.is_dir():
        log.error("--model-repository-cache '%s' is not a folder", args.model_repository_cache)
        return 1
    if args.model_repository_max_model_bytes <= 0:
        log.error("--model-repository-max-model-bytes must be positive")
        return 1
    keep_large_buffers()
    frontend_options = frontend_options_from_args(args, access, raise_file_limit())
    server = Server(options_from_args(args))
    server.log.install()
    warn_open_model_control(args, access)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        if missing:
            raise ServerError(ErrorCode.INVALID_ARG, f"model repository '{missing[0]}' is not a folder")
        await server.start()
    except ServerError as exc:  # a repository missing, or one on object storage that cannot be read
        if args.exit_on_error is not False:
            log.error("%s", exc.message)
            await server.stop()
            return 1
        log.error("the server failed to start and serves on (--exit-on-error=false), not live and not ready: %s",
                  exc.message)
        server.fail_start(exc.message)
    if args.exit_on_error and any(entry.get("state") == "UNAVAILABLE" for entry in server.repository_index()):
        log.error("a model failed to load and --exit-on-error is set")
        await server.stop()
        return 1
    started: list[Frontend] = []
    for listener in build_listeners(server, frontend_options):
        name, host, port = listener.name, listener.address.host, listener.address.port
        try:
            await listener.frontend.start(host, port)
        except OSError as exc:
            log.error("cannot listen for %s on %s:%d: %s", name, host, port, exc)
            await _shutdown(server, started, 0)
            return 1
        started.append(listener.frontend)
        log.info("%s service listening on %s:%d", name, host, port)
    await stop.wait()
    log.info("shutting down: finishing in-flight requests (up to %ss)", args.exit_timeout_secs)
    _exit_backstop(args.exit_timeout_secs + EXIT_BACKSTOP_S)
    await _shutdown(server, started, args.exit_timeout_secs)
    log.info("stopped")
    return 0


#: How long past the exit timeout a shutdown may take (a model's `finalize` gets up to 10 s) before the process
#: exits regardless: what a worker process runs is killed at the timeout, but a thread cannot be.
EXIT_BACKSTOP_S = 15.0


def _exit_backstop(seconds: float) -> None:
    """Exit the process if shutting down takes more than `seconds` (a model thread that never returns, a hung
    finalize); python workers die with it (their parent-death signal)."""

    def expire() -> None:
        log.error("shutdown still not done %gs after it began: exiting now", seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


async def _shutdown(server: Server, frontends: list[Frontend], grace: float) -> None:
    """Stop accepting everywhere, let the core finish and unload, then close the frontends."""
    for frontend in frontends:
        frontend.stop_accepting(grace)
    await server.stop()
    for frontend in frontends:
        await frontend.close()


#: The exit status of a command stopped by Ctrl-C, as a shell reports a process that SIGINT ended.
INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    """Run one command. Ctrl-C ends any of them with one line and status 130, never a traceback; `serve` and
    `serve-ray` take it as their signal to shut down gracefully once they run."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(f"transerve {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED


def _run(args: argparse.Namespace) -> int:
    if args.command == "export":
        return export_command.run(args)
    if args.command == "convert":
        return convert_command.run(args)
    if args.command == "perf":
        return perf_command.run(args)
    if args.command == "client":
        return client_command.run(args)
    if args.command == "serve-ray":
        return ray_command.run(args)
    # The format and the per-level switches are the server's `ServerLog`'s, applied once it exists.
    logging.basicConfig(level=logging.DEBUG if args.log_verbose > 0 else logging.INFO,
                        **({"filename": args.log_file} if args.log_file else {"stream": sys.stderr}))
    access = access_from_args(args)
    grpc_limits_from_args(args)  # a bad value is refused before anything starts
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(args, access))
    return uvloop.run(serve(args, access))


if __name__ == "__main__":
    sys.exit(main())
