"""`transerve convert`: a Hugging Face generation model to a model repository the generation backend serves."""
