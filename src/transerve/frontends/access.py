"""Who may call what, and which request headers reach the model: tritonserver's restricted API groups
(`--http-restricted-api`, `--grpc-restricted-protocol`) and header forwarding (`--http-header-forward-pattern`,
`--grpc-header-forward-pattern`), shared by both frontends.

Every endpoint belongs to one of Triton's groups; the HTTP route table (`frontends/http/routes.py`) and
`GRPC_GROUPS` say which, the way Triton 2.51's routers do, so an endpoint added later only has to be listed under
its group to be restricted like Triton's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

#: Triton's restricted categories, in its order (its help text lists them so).
GROUPS = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository", "statistics",
          "trace", "logging")

#: gRPC's restriction headers carry this prefix before the configured key (Triton's kRestrictedProtocolHeaderTemplate).
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"

#: Each RPC of inference.GRPCInferenceService (and grpc.health.v1's Check) by the group that restricts it.
GRPC_GROUPS = {
    "ServerLive": "health", "ServerReady": "health", "ModelReady": "health", "Check": "health",
    "ServerMetadata": "metadata", "ModelMetadata": "metadata",
    "ModelInfer": "inference", "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository", "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory", "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory", "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory", "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}

def openai_group(parts: list[str]) -> str | None:
    """The group of an OpenAI route, from its path's segments after `/v1`: what a Triton group already guards
    (model listing is `metadata`; completions, chat and embeddings run models: `inference`)."""
    if parts and parts[0] == "models":
        return "metadata"
    if "/".join(parts) in ("completions", "chat/completions", "embeddings"):
        return "inference"
    return None


class OptionError(ValueError):
    """A flag's value cannot be used; the message is tritonserver's for the same mistake."""


@dataclass
class Restrictions:
    """The header (name, value) each restricted group requires; groups not listed are open to everyone.

    `kind` is Triton's word for a group in messages: "api" over HTTP, "protocol" over gRPC.
    """

    kind: str
    required: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, values: Iterable[str], option: str, kind: str, header_prefix: str = "") -> Restrictions:
        """`<group>[,<group>...]:<key>=<value>` flags, each group in at most one of them, as tritonserver parses
        them; OptionError with Triton's message otherwise."""
        restrictions = cls(kind)
        for text in values:
            colon = text.find(":")
            equals = text.find("=", colon + 1) if colon >= 0 else -1
            names, key, value = text[:colon], text[colon + 1:equals], text[equals + 1:]
            if colon < 0 or equals < 0 or not names or not key or not value:
                raise OptionError(f"--{option} option format is '<config name>:<setting>=<value>'. Got {text}")
            for name in names.split(","):
                if name not in GROUPS:
                    raise OptionError(f"unknown restricted {kind} '{name}'")
                if name in restrictions.required:
                    raise OptionError(f"restricted {kind} '{name}' can not be specified in multiple config groups")
                # gRPC metadata keys are lowercase on the wire, so a key written otherwise could never match.
                header = header_prefix + key
                restrictions.required[name] = (header.lower() if header_prefix else header, value)
        return restrictions

    def refusal(self, group: str | None, header: Callable[[str], str | None]) -> str | None:
        """Triton's message when a request of `group` lacks the header its group requires, else None.
        `header(name)` looks a request header up."""
        if group is None or not self.required:
            return None
        need = self.required.get(group)
        if need is None or header(need[0]) == need[1]:
            return None
        return f"This {'API' if self.kind == 'api' else self.kind} is restricted, expecting header '{need[0]}'"


class HeaderForwarding:
    """Request headers whose names match a pattern become string parameters of inference requests.

    The pattern is RE2's, matched anywhere in the name and case-insensitively unless it turns that off
    (`(?-i)...`), as tritonserver does by prefixing `(?i)`; `translate_re2` rewrites RE2's flag groups for `re`.
    """

    def __init__(self, pattern: str, option: str) -> None:
        try:
            self._regex = re.compile(translate_re2(pattern), re.IGNORECASE)
        except (re.error, ValueError) as exc:
            raise OptionError(f"--{option}: '{pattern}' is not a regular expression this server can use: {exc}") \
                from None

    def parameters(self, headers: Iterable[tuple[str, str]]) -> dict[str, str]:
        search = self._regex.search
        return {name: value for name, value in headers if search(name)}


def header_lookup(headers: Mapping[str, str]) -> Callable[[str], str | None]:
    """`Restrictions.refusal`'s lookup over headers stored with lowercase names (HTTP's are case-insensitive)."""
    return lambda name: headers.get(name.lower())


def metadata_lookup(metadata: Iterable[tuple[str, str]]) -> Callable[[str], str | None]:
    """`Restrictions.refusal`'s lookup over a gRPC call's metadata (lowercase names)."""
    return lambda name: next((value for key, value in metadata if key == name), None)


def is_custom_metadata(name: str) -> bool:
    """Whether a gRPC request header is metadata the application sees, as in Triton's `client_metadata()`: not a
    pseudo-header, not HTTP/2's or gRPC's own (`te`, `content-type`, `grpc-*`); `user-agent` is. Binary (`-bin`)
    values are left out: they cannot be the string parameters headers are forwarded as."""
    return not name.startswith((":", "grpc-")) and name not in ("te", "content-type") and not name.endswith("-bin")


def grpcio_metadata(pairs: Iterable[tuple[str, str | bytes]]) -> tuple[tuple[str, str], ...]:
    """grpc.aio's invocation metadata as the native transport's: custom entries only, text values."""
    return tuple((key, value) for key, value in pairs if isinstance(value, str) and is_custom_metadata(key))


_FLAG_GROUP = re.compile(r"\(\?([a-zA-Z]+(?:-[a-zA-Z]*)?|-[a-zA-Z]+)\)")


def translate_re2(pattern: str) -> str:
    """RE2's flag groups for Python's `re`: `(?flags)` sets flags up to the end of the enclosing group in RE2, but
    only at the very start of a pattern in Python, so each becomes a scoped `(?flags:...)` closed where its
    group closes. Escapes and character classes are copied untouched. RE2's `U` (ungreedy) has no equivalent."""
    out: list[str] = []
    pending = [0]  # scoped groups to close, per open group
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if char == "[":
            end = i + 1
            if end < n and pattern[end] == "^":
                end += 1
            if end < n and pattern[end] == "]":
                end += 1
            while end < n and pattern[end] != "]":
                end += 2 if pattern[end] == "\\" else 1
            out.append(pattern[i:end + 1])
            i = end + 1
            continue
        if char == "(":
            flags = _FLAG_GROUP.match(pattern, i)
            if flags is not None:
                if "U" in flags[1]:
                    raise ValueError("RE2's U (ungreedy) flag is not supported")
                out.append(f"(?{flags[1]}:")
                pending[-1] += 1
                i = flags.end()
                continue
            pending.append(0)
        elif char == ")" and len(pending) > 1:
            out.append(")" * pending.pop())
        out.append(char)
        i += 1
    out.append(")" * pending[0])
    return "".join(out)
