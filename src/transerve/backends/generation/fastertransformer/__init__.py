"""FasterTransformer's repositories served on the generation engines: the `fastertransformer` backend name a config
gives (`FasterTransformerBackend`, imported from here by the backend registry) and its checkpoint reader."""

from transerve.backends.generation.fastertransformer.backend import FasterTransformerBackend

__all__ = ["FasterTransformerBackend"]
