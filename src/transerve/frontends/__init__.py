"""Frontends: thin codecs between a wire protocol and the server's request types; each is a `frontend.Frontend`."""
