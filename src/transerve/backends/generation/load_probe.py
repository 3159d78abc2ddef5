"""A warm-up decode of a few tokens on every instance at load, so that an engine that cannot run on its device is
UNAVAILABLE with the reason instead of READY and then failing every request.

Loading a model proves little about its device: CTranslate2 loads the CUDA 12 cuBLAS it multiplies with only at the
first decode, so on a host with only CUDA 13's cuBLAS a model loaded, was listed READY and answered 500 to every
request (issue 22). Decoding two tokens through the engine's own `submit` runs every library the engine needs, on
the instance's own device and threads.
"""

from __future__ import annotations

import re
import threading

from transerve.backends.generation.engine import DecodingOptions, GenerationEngine, GenerationRequest, GenerationResult
from transerve.core.errors import ServerError, unavailable

#: New tokens the warm-up decodes: one step past the first token, so that a step over a cache runs too.
PROBE_NEW_TOKENS = 2
#: Input ids of the warm-up: token 0 exists in every vocabulary, and what it decodes to does not matter.
PROBE_INPUT = [0, 0, 0]
#: How long the warm-up may take: a first CUDA decode compiles kernels and loads libraries for seconds.
PROBE_SECONDS = 300.0

#: What to install when an error names a missing library, by a pattern of the library's name.
_INSTALL_HINTS = (
    (re.compile(r"libcublas(Lt)?\.so\.12"),
     "CUDA 12's cuBLAS: pip install 'transerve[gpu]' (docs/generation.md, 'On a GPU')"),
    (re.compile(r"libcu\w*\.so|libcudnn\w*\.so|libnv\w*\.so"),
     "the CUDA libraries the engine was built for (docs/generation.md, 'On a GPU')"),
)


def install_hint(message: str) -> str | None:
    """What to install for an error that names a CUDA library which did not load; None for other errors."""
    return next((hint for pattern, hint in _INSTALL_HINTS if pattern.search(message)), None)


def probe(engine: GenerationEngine, device: str, timeout: float = PROBE_SECONDS) -> None:
    """Decode `PROBE_NEW_TOKENS` tokens on `engine`; UNAVAILABLE naming `device` and the reason when it cannot."""
    finished = threading.Event()
    outcome: list[GenerationResult | Exception] = []

    def done(result: GenerationResult | Exception) -> None:
        outcome.append(result)
        finished.set()

    ids = PROBE_INPUT[: max(1, engine.max_input_length)]
    engine.submit(GenerationRequest(ids, DecodingOptions(max_new_tokens=PROBE_NEW_TOKENS)), None, done)
    if not finished.wait(timeout):
        raise unavailable(f"the warm-up decode on {device} did not finish within {timeout:g} s")
    if isinstance(outcome[0], Exception):
        error = outcome[0]
        message = error.message if isinstance(error, ServerError) else f"{type(error).__name__}: {error}"
        message = " ".join(message.split())[:400]
        hint = install_hint(message)
        raise unavailable(f"the engine cannot decode on {device}: {message}" + (f"; install {hint}" if hint else ""))
