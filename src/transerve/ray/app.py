"""The Serve application: the replica class as a deployment with `DeploymentSettings`' options, bound to the
replicas' settings. `serve.run(build_app(...), route_prefix="/")` puts the KServe v2 and `/v1` routes at the
root of Serve's HTTP proxy, as a client of `transerve serve` expects them."""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from .deployment import TranserveReplica
from .settings import DeploymentSettings, ReplicaSettings

DEPLOYMENT_NAME = "transerve"


def build_app(replica: ReplicaSettings, deployment: DeploymentSettings) -> Application:
    return serve.deployment(TranserveReplica, name=DEPLOYMENT_NAME).options(**deployment.options()).bind(replica)
