"""Frontends: thin codecs between a wire protocol and the core's request types."""
