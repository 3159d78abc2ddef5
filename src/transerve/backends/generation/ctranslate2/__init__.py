"""The CTranslate2 engine (`engine: "ctranslate2"`): `engine.CTranslate2Engine`, and `model_info`, what it reads of
a converted model folder."""
