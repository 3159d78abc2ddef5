"""`transerve export`: a Hugging Face model folder to a model repository that serves it."""
