"""Which Hugging Face architectures `transerve convert` takes, per engine, from config.json's `model_type`.

CTranslate2: the text-generation models its TransformersConverter has a loader for (encoder-only models and
speech models are left out: the generation backend decodes text from text). Torch: what transformers'
AutoModelForCausalLM or AutoModelForSeq2SeqLM loads.
"""

from __future__ import annotations

from transerve.export.hf import ExportError

#: Model classes of CTranslate2's loaders that generate text from text.
_GENERATION_CLASSES = ("ForCausalLM", "LMHeadModel", "MTModel", "ForConditionalGeneration")
_NOT_TEXT = ("Whisper",)


def ctranslate2_model_types() -> list[str]:
    from ctranslate2.converters import transformers as ct2_transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    configs = {
        config for config, loader in ct2_transformers._MODEL_LOADERS.items()
        if loader.architecture_name.endswith(_GENERATION_CLASSES) and not config.startswith(_NOT_TEXT)
    }
    return sorted(model_type for model_type, config in CONFIG_MAPPING_NAMES.items() if config in configs)


def _torch_mappings() -> list[dict[str, str]]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    return [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES]


def torch_model_types() -> list[str]:
    return sorted({model_type for mapping in _torch_mappings() for model_type in mapping})


def _is_generation_class(name: str) -> bool:
    torch_classes = {cls for mapping in _torch_mappings() for cls in mapping.values()}
    return name in torch_classes or name.endswith(_GENERATION_CLASSES)


def check_architecture(config: dict, engine: str) -> None:
    """ExportError, in one line naming what is supported, when `engine` cannot serve the model of `config`
    (config.json): its model_type must be supported, and its `architectures`, when it names any, must include a
    text-generation class (a BERT classifier is a 'bert' model, which transformers can also load as a decoder)."""
    model_type = str(config.get("model_type"))
    architectures = config.get("architectures") or []
    if engine == "ctranslate2":
        supported = ctranslate2_model_types()
        what = f"the ctranslate2 engine cannot convert a '{model_type}' model"
        names = f"it converts {', '.join(supported)} (or try --engine torch)"
    else:
        supported = torch_model_types()
        what = f"the torch engine cannot serve a '{model_type}' model"
        names = ("it serves what transformers' AutoModelForCausalLM or AutoModelForSeq2SeqLM loads: "
                 f"{', '.join(supported)}")
    if model_type not in supported:
        raise ExportError(f"{what}; {names}")
    if architectures and not any(_is_generation_class(name) for name in architectures):
        raise ExportError(f"{what} holding {', '.join(architectures)}, which does not generate text; {names}")


def is_encoder_decoder(config: dict) -> bool:
    """From config.json's own flag, or, where an older checkpoint leaves it out, from the model type."""
    if "is_encoder_decoder" in config:
        return bool(config["is_encoder_decoder"])
    return str(config.get("model_type")) in _torch_mappings()[1]
