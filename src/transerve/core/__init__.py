"""The transport-agnostic core: request types, validation, errors and the server's model registry."""
