"""Model repositories on disk: which models exist and which of their versions to serve."""
