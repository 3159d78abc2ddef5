"""The `generation` backend: encoder-decoder and decoder-only text generation on CTranslate2 or PyTorch."""
