"""Request parameters that the protocol itself defines (sequences, priority, timeout), shared by both frontends.

They steer the scheduler, so they land in InferRequest fields rather than in the model's parameters.
"""

from __future__ import annotations

from typing import Any

from transerve.core.errors import invalid_arg
from transerve.core.types import InferRequest

SEQUENCE_START = 1
SEQUENCE_END = 2

#: Consumed by a frontend without reaching the request (response encoding, streaming).
FRONTEND_PARAMETERS = frozenset({"binary_data_output", "triton_enable_empty_final_response"})
SCHEDULING_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout"})


def apply_scheduling_parameter(request: InferRequest, key: str, value: Any) -> None:
    """Check one scheduling parameter's value and store it on the request."""
    if key == "sequence_id":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise invalid_arg("'sequence_id' must be an integer or a string")
        request.correlation_id = value
    elif key in ("sequence_start", "sequence_end"):
        if not isinstance(value, bool):
            raise invalid_arg(f"'{key}' must be true or false")
        if value:
            request.flags |= SEQUENCE_START if key == "sequence_start" else SEQUENCE_END
    elif key in ("priority", "timeout"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise invalid_arg(f"'{key}' must be a non-negative integer")
        if key == "priority":
            request.priority = value
        else:
            request.timeout_us = value
    else:
        raise KeyError(key)


#: vLLM's `priority` (the OpenAI API: any integer, lower served earlier, 0 the default) is bounded to
#: +-MAX_OPENAI_PRIORITY and carried as Triton's level (1 the highest): `DEFAULT_LEVEL + priority`, so every vLLM
#: priority is a level of its own, in vLLM's order.
MAX_OPENAI_PRIORITY = 1_000_000
#: The level Triton's priority 0 ("the default level") stands for where no config names one (the generation
#: engines' queues): the level of vLLM's priority 0. A /v2 level below it is served earlier, one above it later.
DEFAULT_LEVEL = MAX_OPENAI_PRIORITY + 1


def level_of_openai_priority(priority: int) -> int:
    """The Triton level of vLLM's `priority` (within +-MAX_OPENAI_PRIORITY, checked by the caller)."""
    return DEFAULT_LEVEL + priority


def queue_level(priority: int) -> int:
    """The level a request's `priority` waits at in a queue with no configured levels: 0 is DEFAULT_LEVEL."""
    return priority or DEFAULT_LEVEL
