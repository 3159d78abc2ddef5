"""`transerve client`: a text file through a served text model, one output line per input line.

A client only: it speaks KServe v2 over HTTP (the standard library) or gRPC (tritonclient) and imports nothing of
the server's layers.
"""
