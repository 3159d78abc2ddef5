"""The OpenAI-compatible API on the HTTP port (docs/openai.md)."""
