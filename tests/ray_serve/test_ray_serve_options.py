"""`transerve serve-ray`'s flags → Serve's deployment options, and its refusals, without Ray (docs/ray.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from transerve.cli import build_parser, main
from transerve.ray.command import settings_from_args


def parse(*flags: str):
    return build_parser().parse_args(["serve-ray", "--model-repository", "repo", *flags])


def test_replicas_become_num_replicas_and_the_repository_an_absolute_path() -> None:
    replica, deployment = settings_from_args(parse("--replicas", "3", "--num-cpus-per-replica", "0.5",
                                                   "--replica-resources", '{"transerve": 1}',
                                                   "--server-flag=--log-verbose=1"))
    options = deployment.options()
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "resources": {"transerve": 1}}
    assert options["max_ongoing_requests"] == 256
    assert replica.repositories == (str(Path("repo").resolve()),)
    (url,) = settings_from_args(build_parser().parse_args(
        ["serve-ray", "--model-repository", "s3://bucket/models"]))[0].repositories
    assert url == "s3://bucket/models"
    assert replica.server_flags == ("--log-verbose=1",)


def test_an_autoscaling_config_replaces_num_replicas() -> None:
    config = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}
    _, deployment = settings_from_args(parse("--autoscaling-config", json.dumps(config),
                                             "--graceful-shutdown-timeout-s", "5"))
    options = deployment.options()
    assert options["autoscaling_config"] == config and "num_replicas" not in options
    assert options["graceful_shutdown_timeout_s"] == 5


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "2", "--autoscaling-config", "{}"], "not allowed with argument"),
    (["--autoscaling-config", "[1]"], "expected a JSON object"),
    (["--replica-resources", "{nope"], "not JSON"),
])
def test_bad_flags_are_refused_with_a_message(flags: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(*flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_zero_replicas_are_refused_before_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-ray", "--model-repository", "repo", "--replicas", "0"]) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="ray is installed")
def test_without_ray_the_extra_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-ray", "--model-repository", "repo"]) == 2
    assert "pip install 'transerve[ray]'" in capsys.readouterr().err
