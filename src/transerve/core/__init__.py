"""The leaf layer every other package shares: request and response types, errors with Triton's codes, datatypes,
tensors from wire data, the model signature (the one validation of a request), statistics, response streams, and
the extensions' own state that backends reach too (log settings, custom metrics, tracing). It imports nothing of
transerve outside itself (tests/test_layering.py)."""
