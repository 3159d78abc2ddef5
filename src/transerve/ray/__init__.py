"""transerve on Ray Serve (docs/ray.md): a Serve application whose replicas each run a `transerve serve` child
process on loopback and forward Serve's HTTP requests to it. Needs the `ray` extra; nothing here imports the
server, so the server's event loop, signals and worker processes stay exactly as `transerve serve` runs them."""
