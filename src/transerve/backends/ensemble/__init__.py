"""Ensembles: a graph of other models whose steps run through the core, like network requests."""
