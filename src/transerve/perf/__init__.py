"""`transerve perf`: a load generator and latency report in the spirit of Triton's perf_analyzer (which cannot be
installed here), and an LLM mode that reports as genai-perf does. A client only: it reaches the server through
tritonclient and HTTP, never through the server's own packages (docs/perf.md)."""
