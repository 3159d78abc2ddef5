"""What `transerve serve-ray` passes to every replica and to Serve: plain data, pickled to the replicas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ReplicaSettings:
    """How each replica runs its `transerve serve` child."""

    repositories: tuple[str, ...]
    server_flags: tuple[str, ...] = ()
    ready_timeout_s: float = 300.0  # a python-backend model starts one worker per instance: slow on small machines
    drain_timeout_s: float = 30.0  # in-flight requests are waited for this long when the replica stops
    exit_grace_s: float = 30.0  # then the child has this long after SIGTERM (it drains too) before SIGKILL
    log_dir: str = ""  # the children's logs; empty: the temporary directory


@dataclass(frozen=True)
class DeploymentSettings:
    """Serve's side: how many replicas (or the autoscaling config), their resources and their probes."""

    num_replicas: int = 1
    autoscaling_config: dict[str, Any] | None = None
    num_cpus: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)
    max_ongoing_requests: int = 256
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 10.0
    graceful_shutdown_timeout_s: float = 30.0
    graceful_shutdown_wait_loop_s: float = 0.5

    def options(self) -> dict[str, Any]:
        """Keyword arguments of `Deployment.options`."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus, **({"resources": self.resources} if self.resources else {})}
        options: dict[str, Any] = {
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": self.graceful_shutdown_wait_loop_s,
        }
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = self.autoscaling_config
        else:
            options["num_replicas"] = self.num_replicas
        return options
