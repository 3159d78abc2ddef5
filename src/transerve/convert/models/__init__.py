"""Python models `transerve convert` copies into repositories as model.py (self-contained: they run in Triton too)."""
