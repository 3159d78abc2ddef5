"""Structured outputs: grammar-constrained decoding (JSON schema, any JSON object, regex, a choice, a Lark/EBNF
grammar) with llguidance (`pip install 'transerve[structured]'`). `constraint` turns what a request asks into a
checked `Constraint` (a 400 naming what is wrong, before anything is queued); `compiler` compiles it once per
tokenizer into matchers (a bounded LRU); `masks` holds each row's matcher state, fills the running batch's token
bitmasks each step and applies them to the logits before a token is chosen."""
