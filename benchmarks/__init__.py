"""transerve's benchmarks, each a module run from the repository root: `python -m benchmarks.<name>`.

Running them as modules makes `benchmarks.common` (the load generators, quiet-machine waiting, server start and JSON
output they share) importable without touching `sys.path`; no benchmark imports another.
"""
