"""Tool-call parsers by model family, chosen per model with the config parameter `openai_tool_call_parser`."""

from transerve.frontends.http.openai.tool_parsers.formats import PARSERS, SPECIAL_MARKERS
from transerve.frontends.http.openai.tool_parsers.stream import Parsed, ToolStream, parse, scanner

__all__ = ["PARSERS", "SPECIAL_MARKERS", "Parsed", "ToolStream", "parse", "scanner"]
