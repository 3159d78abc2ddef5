"""Restricted groups and header forwarding in isolation: which endpoint belongs to which group, the flags'
parsing, and RE2 patterns carried over to Python's `re` (the end-to-end checks against Triton are in
tests/e2e/test_access.py)."""

from __future__ import annotations

import re

import pytest
from tritonclient.grpc import service_pb2

from transerve.frontends.access import (
    GROUPS,
    GRPC_GROUPS,
    HeaderForwarding,
    OptionError,
    Restrictions,
    header_lookup,
    is_custom_metadata,
    translate_re2,
)
from transerve.frontends.http.routes import http_group


@pytest.mark.parametrize(("path", "group"), [
    ("/v2", "metadata"),
    ("/v2/health/live", "health"),
    ("/v2/health/ready", "health"),
    ("/v2/health/other", None),
    ("/v2/models/stats", "statistics"),
    ("/v2/models/m", "metadata"),
    ("/v2/models/m/versions/3", "metadata"),
    ("/v2/models/m/ready", "health"),
    ("/v2/models/m/versions/3/ready", "health"),
    ("/v2/models/m/infer", "inference"),
    ("/v2/models/m/versions/3/infer", "inference"),
    ("/v2/models/m/generate", "inference"),
    ("/v2/models/m/generate_stream", "inference"),
    ("/v2/models/m/config", "model-config"),
    ("/v2/models/m/stats", "statistics"),
    ("/v2/models/m/trace/setting", "trace"),
    ("/v2/models/m/unknown", None),
    ("/v2/trace/setting", "trace"),
    ("/v2/logging", "logging"),
    ("/v2/repository/index", "model-repository"),
    ("/v2/repository/models/m/load", "model-repository"),
    ("/v2/systemsharedmemory/status", "shared-memory"),
    ("/v2/cudasharedmemory/region/r/register", "shared-memory"),
    ("/v2/elsewhere", None),
])
def test_http_endpoints_belong_to_triton_groups(path: str, group: str | None) -> None:
    assert http_group(path.strip("/").split("/")[1:]) == group


def test_every_grpc_method_has_a_group() -> None:
    methods = {method.name for method in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    assert methods | {"Check"} == set(GRPC_GROUPS)
    assert set(GRPC_GROUPS.values()) == set(GROUPS)


def test_restrictions_require_header_and_value() -> None:
    restrictions = Restrictions.parse(["inference,metadata:Infer-Key=v", "model-repository:admin=a:b=c"],
                                      "http-restricted-api", "api")
    assert restrictions.required == {"inference": ("Infer-Key", "v"), "metadata": ("Infer-Key", "v"),
                                     "model-repository": ("admin", "a:b=c")}
    assert restrictions.refusal("inference", header_lookup({"infer-key": "v"})) is None
    assert restrictions.refusal("inference", header_lookup({"infer-key": "V"})) == (
        "This API is restricted, expecting header 'Infer-Key'")
    assert restrictions.refusal("health", header_lookup({})) is None
    assert restrictions.refusal(None, header_lookup({})) is None


def test_grpc_restrictions_prefix_and_lowercase_the_key() -> None:
    restrictions = Restrictions.parse(["health:Key=v"], "grpc-restricted-protocol", "protocol",
                                      "triton-grpc-protocol-")
    assert restrictions.refusal("health", lambda name: None) == (
        "This protocol is restricted, expecting header 'triton-grpc-protocol-key'")


@pytest.mark.parametrize(("value", "message"), [
    ("health", "--http-restricted-api option format is '<config name>:<setting>=<value>'. Got health"),
    (":k=v", "--http-restricted-api option format is '<config name>:<setting>=<value>'. Got :k=v"),
    ("health:=v", "--http-restricted-api option format is '<config name>:<setting>=<value>'. Got health:=v"),
    ("health:k=", "--http-restricted-api option format is '<config name>:<setting>=<value>'. Got health:k="),
    ("health,,metadata:k=v", "unknown restricted api ''"),
    ("metrics:k=v", "unknown restricted api 'metrics'"),
    ("health,health:k=v", "restricted api 'health' can not be specified in multiple config groups"),
])
def test_malformed_restrictions_are_refused_with_tritons_words(value: str, message: str) -> None:
    with pytest.raises(OptionError) as refused:
        Restrictions.parse([value], "http-restricted-api", "api")
    assert str(refused.value) == message


@pytest.mark.parametrize(("pattern", "translated"), [
    ("my_header.*", "my_header.*"),
    ("(?-i)MY_HEADER.*", "(?-i:MY_HEADER.*)"),
    ("a(?i)b|c", "a(?i:b|c)"),
    ("(x(?-i)Y)z", "(x(?-i:Y))z"),
    ("[(?i)]x", "[(?i)]x"),
    (r"\(?s)", r"\(?s)"),
    ("[]a(?i)]", "[]a(?i)]"),
    ("(?P<n>a)(?:b)", "(?P<n>a)(?:b)"),
])
def test_re2_flag_groups_become_scoped_groups(pattern: str, translated: str) -> None:
    assert translate_re2(pattern) == translated


def test_forwarding_matches_names_anywhere_and_case_insensitively_by_default() -> None:
    headers = [("My_Header_1", "a"), ("x-my_header", "b"), ("MY_HEADER_3", "c"), ("other", "d")]
    assert HeaderForwarding("my_header", "p").parameters(headers) == {"My_Header_1": "a", "x-my_header": "b",
                                                                       "MY_HEADER_3": "c"}
    assert HeaderForwarding("(?-i)MY_HEADER.*", "p").parameters(headers) == {"MY_HEADER_3": "c"}
    assert HeaderForwarding("^my", "p").parameters(headers) == {"My_Header_1": "a", "MY_HEADER_3": "c"}


@pytest.mark.parametrize("pattern", ["(", "(?U)a", "a)"])
def test_patterns_python_cannot_run_are_refused(pattern: str) -> None:
    with pytest.raises(OptionError, match=re.escape(f"--p: '{pattern}' is not a regular expression")):
        HeaderForwarding(pattern, "p")


@pytest.mark.parametrize(("name", "custom"), [
    ("my-key", True), ("user-agent", True), ("te", False), ("content-type", False), ("grpc-timeout", False),
    ("grpc-accept-encoding", False), (":path", False), ("trace-bin", False),
])
def test_custom_grpc_metadata_is_what_triton_shows_the_application(name: str, custom: bool) -> None:
    assert is_custom_metadata(name) is custom
