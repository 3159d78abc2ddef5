"""LightSeq's protobuf schemas (transformer.proto, bert.proto, gpt.proto), described here field by field and built
into message classes at import with `descriptor_pb2`, so no generated code is needed.

The same names are LightSeq's HDF5 dataset paths (`encoder_stack/0/ffn_first_kernel`, `model_conf/head_num`), which
is why `weights.py` reads both formats into one flat mapping.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_FLOATS = "floats"
_EMBEDDING = ("token_embedding", "position_embedding", "norm_scale", "norm_bias")
_ENCODER_LAYER = (
    "multihead_norm_scale", "multihead_norm_bias", "multihead_project_kernel_qkv", "multihead_project_bias_qkv",
    "multihead_project_kernel_output", "multihead_project_bias_output", "ffn_norm_scale", "ffn_norm_bias",
    "ffn_first_kernel", "ffn_first_bias", "ffn_second_kernel", "ffn_second_bias",
)
DECODER_LAYER = (
    "self_norm_scale", "self_norm_bias", "self_project_kernel_qkv", "self_project_bias_qkv",
    "self_project_kernel_output", "self_project_bias_output", "encdec_norm_scale", "encdec_norm_bias",
    "encdec_project_kernel_q", "encdec_project_bias_q", "encdec_project_kernel_output", "encdec_project_bias_output",
    "ffn_norm_scale", "ffn_norm_bias", "ffn_first_kernel", "ffn_first_bias", "ffn_second_kernel", "ffn_second_bias",
)
ENCODER_LAYER = _ENCODER_LAYER
TRG_EMBEDDING_EXTRA = ("encode_output_project_kernel_kv", "encode_output_project_bias_kv", "shared_bias", "lang_emb")

#: Per model type: message name -> fields in field-number order, each (name, type): "floats" (repeated float),
#: "int32", "float", "string", "bool", or (message name, repeated).
_SCHEMAS: dict[str, dict[str, list[tuple[str, object]]]] = {
    "Transformer": {
        "EncoderLayer": [(name, _FLOATS) for name in _ENCODER_LAYER],
        "DecoderLayer": [(name, _FLOATS) for name in DECODER_LAYER],
        "EmbeddingLayer": [(name, _FLOATS) for name in _EMBEDDING + TRG_EMBEDDING_EXTRA],
        "ModelConf": [
            ("head_num", "int32"), ("beam_size", "int32"), ("extra_decode_length", "int32"),
            ("length_penalty", "float"), ("src_padding_id", "int32"), ("trg_start_id", "int32"),
            ("diverse_lambda", "float"), ("sampling_method", "string"), ("topp", "float"), ("topk", "int32"),
            ("trg_end_id", "int32"), ("is_post_ln", "bool"), ("no_scale_embedding", "bool"), ("use_gelu", "bool"),
            ("multilg_type", "int32"),
        ],
        "Transformer": [
            ("src_embedding", ("EmbeddingLayer", False)), ("encoder_stack", ("EncoderLayer", True)),
            ("trg_embedding", ("EmbeddingLayer", False)), ("decoder_stack", ("DecoderLayer", True)),
            ("model_conf", ("ModelConf", False)),
        ],
    },
    "Bert": {
        "BertEncoderLayer": [(name, _FLOATS) for name in _ENCODER_LAYER],
        "BertEmbeddingLayer": [(name, _FLOATS) for name in _EMBEDDING],
        "BertModelConf": [
            ("head_num", "int32"), ("src_padding_id", "int32"), ("is_post_ln", "bool"), ("use_gelu", "bool"),
            ("multilg_type", "int32"),
        ],
        "Bert": [
            ("src_embedding", ("BertEmbeddingLayer", False)), ("encoder_stack", ("BertEncoderLayer", True)),
            ("model_conf", ("BertModelConf", False)),
        ],
    },
    "Gpt": {
        "GptEncoderLayer": [(name, _FLOATS) for name in _ENCODER_LAYER],
        "GptEmbeddingLayer": [(name, _FLOATS) for name in _EMBEDDING],
        "GptModelConf": [
            ("head_num", "int32"), ("src_padding_id", "int32"), ("sampling_method", "string"), ("topp", "float"),
            ("topk", "int32"), ("eos_id", "int32"), ("extra_decode_length", "int32"),
        ],
        "Gpt": [
            ("src_embedding", ("GptEmbeddingLayer", False)), ("encoder_stack", ("GptEncoderLayer", True)),
            ("model_conf", ("GptModelConf", False)),
        ],
    },
}
MODEL_TYPES = tuple(_SCHEMAS)

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"int32": _F.TYPE_INT32, "float": _F.TYPE_FLOAT, "string": _F.TYPE_STRING, "bool": _F.TYPE_BOOL}


def _build(model_type: str) -> type:
    """The top-level message class of `model_type`, in a pool of its own (the three schemas reuse names)."""
    package = f"transerve_lightseq_{model_type.lower()}"
    file = descriptor_pb2.FileDescriptorProto(name=f"{package}.proto", package=package, syntax="proto3")
    for message_name, fields in _SCHEMAS[model_type].items():
        message = file.message_type.add(name=message_name)
        for number, (field_name, kind) in enumerate(fields, start=1):
            field = message.field.add(name=field_name, number=number)
            if kind == _FLOATS:
                field.type, field.label = _F.TYPE_FLOAT, _F.LABEL_REPEATED
            elif isinstance(kind, tuple):
                field.type, field.type_name = _F.TYPE_MESSAGE, f".{package}.{kind[0]}"
                field.label = _F.LABEL_REPEATED if kind[1] else _F.LABEL_OPTIONAL
            else:
                field.type, field.label = _SCALARS[kind], _F.LABEL_OPTIONAL
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{model_type}"))


_CLASSES: dict[str, type] = {}


def message_class(model_type: str) -> type:
    """LightSeq's top-level message (`Transformer`, `Bert`, `Gpt`), built once."""
    if model_type not in _CLASSES:
        _CLASSES[model_type] = _build(model_type)
    return _CLASSES[model_type]
