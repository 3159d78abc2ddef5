"""The KServe v2 routes under `/v2` as one table (and vLLM's few service routes at the root as another): each
route's path pattern, the methods it answers, the handler that answers it, and the restricted-API group that
guards it (`--http-restricted-api`), the way Triton 2.51's HTTP router lists them. An endpoint added later is
one row here: it is routed and restricted at once.

A pattern is the path's segments after `/v2`: literal text, a `{name}` captured into the handler's arguments
(`{name+}` when it may not be empty), or a last `*` that matches whatever follows (a section's catch-all, so that
its unknown paths still belong to its group and answer as Triton does). Rows are tried in order; a path that
matches a row whose methods do not include the request's is a 405, one that matches none a 404.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GET, POST = frozenset({"GET"}), frozenset({"POST"})
GET_POST = GET | POST
#: Any method reaches the handler (the catch-alls that answer 404 whatever the method).
ANY: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Route:
    pattern: tuple[str, ...]
    methods: frozenset[str]
    #: The name of the `HttpFrontend` method that answers it (the table is data; the app binds the names).
    handler: str
    group: str | None
    #: (position, text) of the literal segments and (position, name, may be empty) of the captured ones.
    _literals: tuple[tuple[int, str], ...] = field(init=False, repr=False, compare=False)
    _captures: tuple[tuple[int, str, bool], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        literals, captures = [], []
        for position, segment in enumerate(self.pattern):
            if segment.startswith("{"):
                name = segment.strip("{}+")
                captures.append((position, name, not segment.endswith("+}")))
            elif segment != "*":
                literals.append((position, segment))
        object.__setattr__(self, "_literals", tuple(literals))
        object.__setattr__(self, "_captures", tuple(captures))

    @property
    def open_ended(self) -> bool:
        return bool(self.pattern) and self.pattern[-1] == "*"

    def bind(self, parts: list[str]) -> tuple[str, ...] | None:
        """The captured segments, in order, when `parts` match the pattern (its length already checked)."""
        for position, text in self._literals:
            if parts[position] != text:
                return None
        captures = self._captures
        if not captures:
            return ()
        if len(captures) == 1:
            position, _, may_be_empty = captures[0]
            value = parts[position]
            return (value,) if value or may_be_empty else None
        values = tuple([parts[position] for position, _, _ in captures])
        if all(value or may_be_empty for (_, _, may_be_empty), value in zip(captures, values, strict=True)):
            return values
        return None

    @property
    def captures(self) -> tuple[str, ...]:
        return tuple(name for _, name, _ in self._captures)

    def allows(self, method: str) -> bool:
        return not self.methods or method in self.methods


def _model_routes(action: str, methods: frozenset[str], handler: str, group: str) -> tuple[Route, ...]:
    """A model's endpoint, for its serving version and for one named (`/versions/<v>/`)."""
    suffix = (action,) if action else ()
    return (Route(("models", "{model}", *suffix), methods, handler, group),
            Route(("models", "{model}", "versions", "{version}", *suffix), methods, handler, group))


def _shared_memory_routes(section: str, kind: str) -> tuple[Route, ...]:
    return (
        Route((section, "status"), GET, f"{kind}_status", "shared-memory"),
        Route((section, "region", "{region+}", "status"), GET, f"{kind}_status", "shared-memory"),
        Route((section, "region", "{region+}", "register"), POST, f"{kind}_register", "shared-memory"),
        Route((section, "unregister"), POST, f"{kind}_unregister", "shared-memory"),
        Route((section, "region", "{region+}", "unregister"), POST, f"{kind}_unregister", "shared-memory"),
        Route((section, "*"), ANY, "not_found", "shared-memory"),
    )


ROUTES: tuple[Route, ...] = (
    # Inference first: the rows a busy server matches most.
    *_model_routes("infer", POST, "infer", "inference"),
    *_model_routes("generate", POST, "generate", "inference"),
    *_model_routes("generate_stream", POST, "generate_stream", "inference"),
    Route((), GET, "server_metadata", "metadata"),
    Route(("health", "live"), GET, "live", "health"),
    Route(("health", "ready"), GET, "ready", "health"),
    Route(("models", "stats"), GET, "all_statistics", "statistics"),
    *_model_routes("", GET, "model_metadata", "metadata"),
    *_model_routes("ready", GET, "model_ready", "health"),
    *_model_routes("config", GET, "model_config", "model-config"),
    *_model_routes("stats", GET, "model_statistics", "statistics"),
    Route(("models", "{model}", "trace", "setting"), GET_POST, "model_trace_setting", "trace"),
    # A version's trace settings are no endpoint, but Triton's router puts the path in the trace group.
    Route(("models", "{model}", "versions", "{version}", "trace", "setting"), ANY, "not_found", "trace"),
    # `/v2/repository` itself belongs to no group, and answers other methods than POST with 405 as Triton does.
    Route(("repository",), POST, "not_found", None),
    Route(("repository", "index"), POST, "repository_index", "model-repository"),
    Route(("repository", "models", "{model}", "load"), POST, "load", "model-repository"),
    Route(("repository", "models", "{model}", "unload"), POST, "unload", "model-repository"),
    # Triton answers any other method under /v2/repository with 405, and POST to an unknown path with 404.
    Route(("repository", "*"), POST, "not_found", "model-repository"),
    *_shared_memory_routes("systemsharedmemory", "system_shm"),
    *_shared_memory_routes("cudasharedmemory", "cuda_shm"),
    Route(("trace", "setting"), GET_POST, "trace_setting", "trace"),
    Route(("logging",), GET_POST, "logging", "logging"),
)


#: vLLM's service routes at the root (the path's segments from `/`), answered beside `/v1`: liveness for probes
#: and tools written for vLLM (guidellm checks `/health`), the server's version, and its tokenizer endpoints.
SERVICE_ROUTES: tuple[Route, ...] = (
    Route(("health",), GET, "service_health", "health"),
    Route(("version",), GET, "service_version", "metadata"),
    Route(("tokenize",), POST, "tokenize", "inference"),
    Route(("detokenize",), POST, "detokenize", "inference"),
)


class RouteTable:
    """The rows by the length of path they match and their first and last segments, the open-ended ones after.
    A path tries the rows whose last segment is its own before those that capture it (`models/stats` before
    `models/{model}`), each group in table order: a lookup or two and a short scan, on every request."""

    def __init__(self, routes: tuple[Route, ...] = ROUTES) -> None:
        self._exact: dict[tuple[int, str, str | None], list[Route]] = {}
        self._open: list[Route] = []
        for route in routes:
            if route.open_ended:
                self._open.append(route)
                continue
            pattern = route.pattern
            first = pattern[0] if pattern else ""
            last = pattern[-1] if len(pattern) > 1 and not pattern[-1].startswith("{") else None
            self._exact.setdefault((len(pattern), first, last), []).append(route)

    def match(self, parts: list[str]) -> tuple[Route, tuple[str, ...]] | None:
        """The row `parts` (the path's segments after `/v2`) match, with its captured segments."""
        size = len(parts)
        first = parts[0] if parts else ""
        exact = self._exact
        for key in ((size, first, parts[-1]), (size, first, None)) if size > 1 else ((size, first, None),):
            for route in exact.get(key, ()):
                values = route.bind(parts)
                if values is not None:
                    return route, values
        for route in self._open:
            if size >= len(route.pattern) and route.bind(parts) is not None:
                return route, ()
        return None


TABLE = RouteTable()
SERVICE_TABLE = RouteTable(SERVICE_ROUTES)


def http_group(parts: list[str]) -> str | None:
    """The restricted-API group of a path (its segments after `/v2`); None for a path that is no endpoint."""
    matched = TABLE.match(parts)
    return None if matched is None else matched[0].group
