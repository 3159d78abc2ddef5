"""`transerve serve-ray`: the model repository served by N replicas (or Serve's autoscaling) behind Ray Serve's
HTTP proxy, until SIGINT or SIGTERM; then the application is deleted, which drains every replica.

Flags for the replicas' own `transerve serve` go in `--server-flag` (repeatable); their listeners are always
loopback ports of their own, chosen by each replica."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from transerve.core.extras import MissingExtra, import_optional

from .settings import DeploymentSettings, ReplicaSettings

APP_NAME = "transerve"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve-ray", help="serve a model repository from N transerve replicas behind Ray Serve (docs/ray.md)",
        description="Each replica runs `transerve serve` on loopback and forwards Serve's HTTP requests to it; "
                    "the KServe v2 and /v1 routes are at the root of Serve's HTTP address.")
    add = parser.add_argument
    add("--model-repository", dest="model_repository", action="append", required=True, metavar="PATH",
        help="a model repository (repeatable): a local path, which must exist on every node replicas may run on, "
             "or an object-storage URL (s3://, gs://, as://), which each replica's server reads into its own cache")
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--replicas", type=int, default=1, metavar="N", help="fixed number of replicas (default 1)")
    scale.add_argument("--autoscaling-config", type=_json_object, metavar="JSON",
                       help="Serve's autoscaling_config, e.g. '{\"min_replicas\": 1, \"max_replicas\": 4, "
                            "\"target_ongoing_requests\": 16}'")
    add("--http-host", default="127.0.0.1", help="Serve's HTTP proxy address (default 127.0.0.1)")
    add("--http-port", type=int, default=8000, help="Serve's HTTP proxy port (default 8000)")
    add("--proxy-location", choices=["EveryNode", "HeadOnly"], default="EveryNode",
        help="where Serve runs HTTP proxies; HeadOnly when several nodes share one host's ports")
    add("--ray-address", default=None, metavar="ADDRESS",
        help="an existing Ray cluster (e.g. 127.0.0.1:6379 or auto); default: a local one for this command")
    add("--num-cpus-per-replica", type=float, default=1.0, metavar="N")
    add("--replica-resources", type=_json_object, default={}, metavar="JSON",
        help="custom resources each replica needs, e.g. '{\"models\": 1}'")
    add("--max-ongoing-requests", type=int, default=256, metavar="N",
        help="requests Serve sends one replica at once (default 256: the server queues and batches them)")
    add("--health-check-period-s", type=float, default=2.0)
    add("--graceful-shutdown-timeout-s", type=float, default=30.0,
        help="how long a stopping replica's requests are waited for (Serve's, then the replica's own drain)")
    add("--ready-timeout-s", type=float, default=300.0, help="how long a replica's server may take to be ready")
    add("--server-flag", dest="server_flags", action="append", default=[], metavar="FLAG",
        help="a flag for each replica's `transerve serve`, e.g. --server-flag=--log-verbose=1 (repeatable)")
    add("--log-dir", default="", help="where replicas write their server's log (default: the temporary directory)")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _absolute(repository: str) -> str:
    """A local path made absolute (replicas start elsewhere); an object-storage URL as given."""
    return repository if "://" in repository else str(Path(repository).resolve())


def settings_from_args(args: argparse.Namespace) -> tuple[ReplicaSettings, DeploymentSettings]:
    if args.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    replica = ReplicaSettings(
        repositories=tuple(_absolute(path) for path in args.model_repository),
        server_flags=tuple(args.server_flags), ready_timeout_s=args.ready_timeout_s,
        drain_timeout_s=args.graceful_shutdown_timeout_s, log_dir=args.log_dir)
    deployment = DeploymentSettings(
        num_replicas=args.replicas, autoscaling_config=args.autoscaling_config,
        num_cpus=args.num_cpus_per_replica, resources=args.replica_resources,
        max_ongoing_requests=args.max_ongoing_requests, health_check_period_s=args.health_check_period_s,
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s)
    return replica, deployment


def run(args: argparse.Namespace) -> int:
    try:
        replica, deployment = settings_from_args(args)
        ray = import_optional("ray", "ray")
        serve = import_optional("ray.serve", "ray")
        from .app import build_app
    except (ValueError, MissingExtra) as error:
        print(f"transerve serve-ray: {error}", file=sys.stderr)
        return 2
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(proxy_location=args.proxy_location, http_options={"host": args.http_host, "port": args.http_port})
        serve.run(build_app(replica, deployment), name=APP_NAME, route_prefix="/")
        print(f"transerve serve-ray: serving at http://{args.http_host}:{args.http_port}", flush=True)
        stop.wait()
        serve.delete(APP_NAME)  # Serve drains each replica, then the replica drains and stops its server
        if not serve.status().applications:
            serve.shutdown()  # Serve's proxy keeps its options while it runs: the next serve-ray may want others
    finally:
        ray.shutdown()
    return 0
