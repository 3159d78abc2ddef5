"""Property-based tests of both protocols' tensor codecs: KServe v2 JSON with Triton's binary extension (HTTP) and
ModelInferRequest's raw_input_contents and typed contents (gRPC). Tensors of any datatype and shape decode to what
was sent and come back unchanged through the response encoder; hostile requests decode or are INVALID_ARG (or
NOT_FOUND for a shared memory region that does not exist), never any other exception."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from hypothesis import given
from hypothesis import strategies as st
from support.grpc_tensors import TYPED_FIELDS
from tritonclient.grpc import service_pb2

from transerve.core.datatypes import ELEMENT_SIZE, NUMPY_DTYPES
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.tensors import wire_bytes
from transerve.core.types import InferResponse, Tensor
from transerve.frontends.grpc import codec as grpc_codec
from transerve.frontends.http import codec as http_codec

DATATYPES = sorted(NUMPY_DTYPES)
_SHAPES = st.lists(st.integers(0, 4), max_size=4)


def _refused_properly(exc: ServerError) -> None:
    assert exc.code == ErrorCode.INVALID_ARG or (exc.code == ErrorCode.NOT_FOUND and "shared memory" in exc.message), \
        (exc.code, exc.message)


@st.composite
def tensors(draw: st.DrawFn, name: str = "T") -> Tensor:
    """A tensor of any datatype: its elements from raw bytes (every bit pattern, NaNs included) or strings."""
    datatype = draw(st.sampled_from(DATATYPES))
    shape = tuple(draw(_SHAPES))
    count = int(np.prod(shape, dtype=np.int64))
    if datatype == "BYTES":
        items = draw(st.lists(st.binary(max_size=12), min_size=count, max_size=count))
        data = np.empty(count, dtype=np.object_)
        data[:] = items
    elif datatype == "BOOL":
        data = np.array(draw(st.lists(st.booleans(), min_size=count, max_size=count)), dtype=np.bool_)
    else:
        size = count * ELEMENT_SIZE[datatype]
        data = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=NUMPY_DTYPES[datatype])
    return Tensor(name, datatype, data.reshape(shape))


def _same(a: Tensor, b: Tensor) -> None:
    assert (a.name, a.datatype, a.shape) == (b.name, b.datatype, b.shape)
    assert wire_bytes(a) == wire_bytes(b)


def _json_values(tensor: Tensor) -> Any | None:
    """The tensor as JSON `data`, or None when JSON cannot carry it exactly (non-finite floats, bytes not UTF-8)."""
    data = tensor.data.reshape(-1)
    if tensor.datatype == "BYTES":
        try:
            return [item.decode("utf-8") for item in data]
        except UnicodeDecodeError:
            return None
    if tensor.datatype in ("FP16", "BF16", "FP32", "FP64"):
        values = data.astype(np.float64)
        return values.tolist() if np.isfinite(values).all() else None
    return data.tolist()


# ---- HTTP: KServe v2 JSON and the binary extension ----------------------------------------------------------


def _http_body(inputs: list[Tensor], binary: list[bool]) -> tuple[bytes, str | None]:
    entries, blobs = [], []
    for tensor, as_binary in zip(inputs, binary, strict=True):
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}
        values = None if as_binary else _json_values(tensor)
        if values is None:
            blob = wire_bytes(tensor)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = values
        entries.append(entry)
    header = orjson.dumps({"inputs": entries})
    return header + b"".join(blobs), str(len(header)) if blobs else None


@given(inputs=st.lists(st.integers(0, 9).flatmap(lambda i: tensors(f"IN{i}")), max_size=4,
                       unique_by=lambda tensor: tensor.name),
       binary=st.lists(st.booleans(), min_size=4, max_size=4), binary_out=st.booleans())
def test_http_tensors_round_trip(inputs: list[Tensor], binary: list[bool], binary_out: bool) -> None:
    body, header_length = _http_body(inputs, binary[:len(inputs)])
    request, _ = http_codec.decode_infer_request("m", "", body, header_length)
    for sent, got in zip(inputs, request.inputs, strict=True):
        _same(sent, got)
    # The response encoder's document is the request's with `outputs` for `inputs`: decode it back. In JSON, a
    # float that is not finite can only be null, and bytes only UTF-8: those go as binary, or not at all.
    if not binary_out and any(_json_values(tensor) is None for tensor in inputs if tensor.datatype != "BYTES"):
        return
    response = InferResponse("m", "1", list(request.inputs))
    try:
        encoded, split = http_codec.encode_infer_response(response, request, binary_out)
    except ServerError as exc:  # JSON cannot carry bytes that are not UTF-8: refused, as asked of binary_data
        assert not binary_out and exc.code == ErrorCode.INVALID_ARG
        return
    document = orjson.loads(encoded[:split] if split else encoded)
    document["inputs"] = document.pop("outputs")
    header = orjson.dumps(document)
    again, _ = http_codec.decode_infer_request("m", "", header + (encoded[split:] if split else b""),
                                               str(len(header)) if split else None)
    for sent, got in zip(inputs, again.inputs, strict=True):
        if sent.datatype in ("FP16", "BF16", "FP32", "FP64") and not binary_out:
            assert np.array_equal(sent.data.astype(np.float64), got.data.astype(np.float64), equal_nan=True)
        else:
            _same(sent, got)


_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
              st.text(max_size=8)),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children,
                                                                               max_size=4)),
    max_leaves=12,
)
_HOSTILE_SHAPES = st.one_of(
    st.lists(st.one_of(st.integers(0, 3), st.sampled_from([2**31, 2**62, 2**63, 2**64 - 1, -1])), max_size=5),
    st.integers(60, 70).map(lambda n: [1] * n),
    st.lists(st.integers(0, 2), min_size=1, max_size=3).map(lambda shape: [0, *shape, 2**63]),
    _JSON,
)


@st.composite
def hostile_input(draw: st.DrawFn) -> dict[str, Any]:
    entry: dict[str, Any] = {}
    if draw(st.integers(0, 9)):
        entry["name"] = draw(st.one_of(st.just("IN"), _JSON))
    if draw(st.integers(0, 9)):
        entry["datatype"] = draw(st.one_of(st.sampled_from(DATATYPES), _JSON))
    if draw(st.integers(0, 9)):
        entry["shape"] = draw(_HOSTILE_SHAPES)
    source = draw(st.sampled_from(["data", "binary", "shm", "none", "junk"]))
    if source == "data":
        entry["data"] = draw(_JSON)
    elif source == "binary":
        entry["parameters"] = {"binary_data_size": draw(st.one_of(st.integers(-2, 40), _JSON))}
    elif source == "shm":
        entry["parameters"] = {"shared_memory_region": draw(_JSON), "shared_memory_byte_size": draw(_JSON)}
    elif source == "junk":
        entry["parameters"] = draw(_JSON)
    return entry


@given(inputs=st.lists(hostile_input(), max_size=3), outputs=st.one_of(st.none(), _JSON),
       parameters=st.one_of(st.none(), _JSON), blob=st.binary(max_size=48),
       header_length=st.one_of(st.none(), st.just("exact"), st.text(max_size=6)), whole=st.one_of(st.none(), _JSON))
def test_hostile_http_bodies_are_invalid_arg(inputs: list[dict[str, Any]], outputs: Any, parameters: Any, blob: bytes,
                                             header_length: str | None, whole: Any) -> None:
    document: Any = {"inputs": inputs}
    if outputs is not None:
        document["outputs"] = outputs
    if parameters is not None:
        document["parameters"] = parameters
    if whole is not None:
        document = whole
    header = orjson.dumps(document)
    if header_length == "exact":
        header_length = str(len(header))
    try:
        request, _ = http_codec.decode_infer_request("m", "", header + blob if header_length else header,
                                                     header_length)
    except ServerError as exc:
        _refused_properly(exc)
    else:
        for tensor in request.inputs:
            assert tensor.data.size == int(np.prod(tensor.shape, dtype=object))


# ---- gRPC: ModelInferRequest ---------------------------------------------------------------------------------


def _contents(message: service_pb2.ModelInferRequest.InferInputTensor, tensor: Tensor) -> bool:
    """Put the tensor into typed `contents`; False for FP16 and BF16, which have no field there."""
    field = TYPED_FIELDS.get(tensor.datatype)
    if field is None:
        return False
    getattr(message.contents, field).extend(tensor.data.reshape(-1).tolist())
    return True


@given(inputs=st.lists(st.integers(0, 9).flatmap(lambda i: tensors(f"IN{i}")), max_size=4,
                       unique_by=lambda tensor: tensor.name), typed=st.booleans())
def test_grpc_tensors_round_trip(inputs: list[Tensor], typed: bool) -> None:
    message = service_pb2.ModelInferRequest(model_name="m")
    typed = typed and all(tensor.datatype not in ("FP16", "BF16") for tensor in inputs)
    for tensor in inputs:
        entry = message.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        if typed:
            _contents(entry, tensor)
        else:
            message.raw_input_contents.append(wire_bytes(tensor))
    request = grpc_codec.decode_infer_request(service_pb2.ModelInferRequest.FromString(message.SerializeToString()))
    for sent, got in zip(inputs, request.inputs, strict=True):
        if typed and sent.datatype in ("FP32", "FP64"):  # a NaN's payload may change as a Python float
            assert np.array_equal(sent.data, got.data, equal_nan=True) and sent.shape == got.shape
        else:
            _same(sent, got)
    if typed:
        return
    answer = service_pb2.ModelInferResponse.FromString(
        grpc_codec.encode_infer_response_bytes(InferResponse("m", "1", list(request.inputs))))
    for sent, output, raw in zip(inputs, answer.outputs, answer.raw_output_contents, strict=True):
        assert (output.name, output.datatype, list(output.shape)) == (sent.name, sent.datatype, sent.shape)
        assert raw == wire_bytes(sent)


_INT64 = st.one_of(st.integers(-2, 4), st.sampled_from([2**31, 2**62, 2**63 - 1, -(2**63)]))


@st.composite
def hostile_message(draw: st.DrawFn) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="m", model_version=draw(st.sampled_from(["", "1", "x", "-1"])))
    for index in range(draw(st.integers(0, 3))):
        entry = message.inputs.add(name=f"IN{index}", datatype=draw(st.one_of(st.sampled_from(DATATYPES),
                                                                              st.text(max_size=5))))
        entry.shape.extend(draw(st.one_of(st.lists(_INT64, max_size=5), st.integers(60, 70).map(lambda n: [1] * n),
                                          st.just([0, 2**63 - 1]))))
        typed = draw(st.sampled_from(["none", "bool_contents", "int_contents", "int64_contents", "uint_contents",
                                      "uint64_contents", "fp32_contents", "fp64_contents", "bytes_contents", "two"]))
        values = draw(st.lists(st.integers(0, 1), max_size=6))
        if typed == "bytes_contents":
            message.inputs[index].contents.bytes_contents.extend(bytes([v]) for v in values)
        elif typed == "two":
            message.inputs[index].contents.int_contents.extend(values)
            message.inputs[index].contents.fp32_contents.extend(values)
        elif typed != "none":
            getattr(message.inputs[index].contents, typed).extend(
                [bool(v) for v in values] if typed == "bool_contents" else values)
        if draw(st.booleans()):
            entry.parameters["shared_memory_region"].string_param = "r"
    for _ in range(draw(st.integers(0, 3))):
        message.raw_input_contents.append(draw(st.binary(max_size=24)))
    for _ in range(draw(st.integers(0, 2))):
        output = message.outputs.add(name=draw(st.text(max_size=4)))
        if draw(st.booleans()):
            output.parameters["classification"].int64_param = draw(_INT64)
    for key in draw(st.lists(st.sampled_from(["priority", "timeout", "sequence_id", "binary_data_output", "x",
                                              "triton_x", "sequence_start"]), max_size=3)):
        parameter = message.parameters[key]
        kind = draw(st.sampled_from(["bool_param", "int64_param", "string_param", "double_param", "uint64_param"]))
        setattr(parameter, kind, {"bool_param": True, "int64_param": draw(_INT64), "string_param": "s",
                                  "double_param": 1.5, "uint64_param": 2**64 - 1}[kind])
    return message


@given(message=hostile_message())
def test_hostile_grpc_requests_are_invalid_arg(message: service_pb2.ModelInferRequest) -> None:
    try:
        request = grpc_codec.decode_infer_request(message)
    except ServerError as exc:
        _refused_properly(exc)
    else:
        for tensor in request.inputs:
            assert tensor.data.size == int(np.prod(tensor.shape, dtype=object))
