"""The `lightseq` backend: LightSeq's exported Transformer, Bert and Gpt files, served as its Triton backend does."""
