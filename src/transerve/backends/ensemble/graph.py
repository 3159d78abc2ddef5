"""An ensemble's steps as a checked graph: every tensor has one producer, types and shapes agree, no cycles.

All checks happen at load, with one-line reasons, so a broken ensemble is UNAVAILABLE instead of failing
its first requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2

from transerve.config.model_config import ConfigError
from transerve.core.signature import ModelSignature, TensorSpec


@dataclass(frozen=True, slots=True)
class Step:
    """One step: which model, and how its tensors are named in the ensemble."""

    index: int
    model_name: str
    model_version: str
    #: step model input name -> ensemble tensor name.
    inputs: dict[str, str]
    #: step model output name -> ensemble tensor name.
    outputs: dict[str, str]

    @property
    def label(self) -> str:
        return f"step {self.index} (model '{self.model_name}')"


def build_steps(
    name: str, config: model_config_pb2.ModelConfig, signatures: dict[tuple[str, str], ModelSignature]
) -> list[Step]:
    """Check the ensemble against its composing models' signatures; return its steps in config order.

    `signatures` maps (model name, version or "") to the signature of each composing model.
    """
    if not config.HasField("ensemble_scheduling") or not config.ensemble_scheduling.step:
        raise ConfigError(f"ensemble '{name}' has no ensemble_scheduling steps")
    own = ModelSignature(name, config)
    producers: dict[str, str] = {tensor: "the ensemble input" for tensor in own.inputs}
    specs: dict[str, TensorSpec] = dict(own.inputs)
    steps = []
    for index, raw in enumerate(config.ensemble_scheduling.step):
        version = "" if raw.model_version < 0 else str(raw.model_version)
        step = Step(index, raw.model_name, version, dict(raw.input_map), dict(raw.output_map))
        signature = signatures.get((raw.model_name, version))
        if signature is None:
            raise ConfigError(f"ensemble '{name}': {step.label} names a model that is not loaded"
                              + (f" in version {version}" if version else ""))
        _check_batching(name, step, own, signature)
        for model_input, tensor in step.inputs.items():
            if model_input not in signature.inputs:
                raise ConfigError(f"ensemble '{name}': {step.label} maps '{tensor}' to '{model_input}', "
                                  f"which is not an input of '{step.model_name}'")
        missing = [i for i in signature.required if i not in step.inputs]
        if missing:
            raise ConfigError(f"ensemble '{name}': {step.label} leaves required inputs {missing} unmapped")
        for model_output, tensor in step.outputs.items():
            spec = signature.outputs.get(model_output)
            if spec is None:
                raise ConfigError(f"ensemble '{name}': {step.label} maps output '{model_output}', which is not "
                                  f"an output of '{step.model_name}'")
            if tensor in producers:
                raise ConfigError(f"ensemble '{name}': tensor '{tensor}' is produced by both {producers[tensor]} "
                                  f"and {step.label}")
            producers[tensor] = step.label
            specs[tensor] = spec
        steps.append(step)
    _check_consumers(name, steps, signatures, specs, producers)
    _check_outputs(name, own, specs, producers)
    _check_acyclic(name, steps, own)
    return steps


def needed_steps(steps: list[Step], outputs: Iterable[str], wanted: Iterable[str]) -> list[Step]:
    """The steps a request that asks for only the `wanted` ensemble outputs runs, in config order.

    As Triton prunes them: a step is left out when each tensor it produces is an output nobody asked for or
    feeds only steps left out (a step output that goes nowhere keeps its step, as Triton keeps it). One pass back
    from the tensors needed to the steps producing them, so a large graph costs its size, not its size squared.
    """
    #: Tensors something reads: a step, or the ensemble's response.
    read = {tensor for step in steps for tensor in step.inputs.values()}.union(outputs)
    producer = {tensor: step for step in steps for tensor in step.outputs.values()}
    kept = {step.index for step in steps if any(tensor not in read for tensor in step.outputs.values())}
    pending = list(wanted)
    pending.extend(tensor for step in steps if step.index in kept for tensor in step.inputs.values())
    while pending:
        step = producer.get(pending.pop())
        if step is not None and step.index not in kept:
            kept.add(step.index)
            pending.extend(step.inputs.values())
    return [step for step in steps if step.index in kept]


def _check_batching(name: str, step: Step, own: ModelSignature, signature: ModelSignature) -> None:
    """A step that batches must take the ensemble's largest batch; one that does not batch takes the whole tensor
    (its dims then name the batch dimension, which `_compatible` allows for), as Triton accepts."""
    if own.max_batch_size > 0 and 0 < signature.max_batch_size < own.max_batch_size:
        raise ConfigError(f"ensemble '{name}' batches up to {own.max_batch_size} but {step.label} only up to "
                          f"{signature.max_batch_size}")


def _check_consumers(
    name: str,
    steps: list[Step],
    signatures: dict[tuple[str, str], ModelSignature],
    specs: dict[str, TensorSpec],
    producers: dict[str, str],
) -> None:
    consumed: set[str] = set()
    for step in steps:
        signature = signatures[(step.model_name, step.model_version)]
        for model_input, tensor in step.inputs.items():
            consumed.add(tensor)
            if tensor not in producers:
                raise ConfigError(f"ensemble '{name}': {step.label} reads '{tensor}', which is neither an ensemble "
                                  "input nor any step's output")
            produced, wanted = specs[tensor], signature.inputs[model_input]
            if produced.datatype != wanted.datatype:
                raise ConfigError(f"ensemble '{name}': '{tensor}' is {produced.datatype} from {producers[tensor]} "
                                  f"but {step.label} input '{model_input}' expects {wanted.datatype}")
            if not _compatible(produced, wanted):
                raise ConfigError(f"ensemble '{name}': '{tensor}' has dims {list(produced.dims)} from "
                                  f"{producers[tensor]} but {step.label} input '{model_input}' expects "
                                  f"{list(wanted.dims)}")
    unused = [tensor for tensor, producer in producers.items()
              if producer == "the ensemble input" and tensor not in consumed]
    if unused:
        raise ConfigError(f"ensemble '{name}': inputs {unused} are not used by any step")


def _check_outputs(name: str, own: ModelSignature, specs: dict[str, TensorSpec], producers: dict[str, str]) -> None:
    for output, spec in own.outputs.items():
        if output not in producers:
            raise ConfigError(f"ensemble '{name}': output '{output}' is not produced by any step")
        produced = specs[output]
        if produced.datatype != spec.datatype:
            raise ConfigError(f"ensemble '{name}': output '{output}' is {produced.datatype} from "
                              f"{producers[output]} but the ensemble declares {spec.datatype}")
        if not _compatible(produced, spec):
            raise ConfigError(f"ensemble '{name}': output '{output}' has dims {list(produced.dims)} from "
                              f"{producers[output]} but the ensemble declares {list(spec.dims)}")


def _compatible(a: TensorSpec, b: TensorSpec) -> bool:
    """Equal dims (-1 matching anything), or else equal full shapes: a model without batching that declares
    `[-1, 1]` passes its tensors to and from one that batches `[1]` (Triton compares both ways too)."""
    return _same_dims(a.dims, b.dims) or _same_dims(a.shape, b.shape)


def _same_dims(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b, strict=True))


def _check_acyclic(name: str, steps: list[Step], own: ModelSignature) -> None:
    """Kahn's walk from the ensemble inputs: every step must become runnable. Each step waits on a count of the
    tensors it still lacks, so the walk is linear in the graph's size."""
    waiting = {step.index: set(step.inputs.values()) - set(own.inputs) for step in steps}
    readers: dict[str, list[Step]] = {}
    for step in steps:
        for tensor in waiting[step.index]:
            readers.setdefault(tensor, []).append(step)
    lacking = {index: len(tensors) for index, tensors in waiting.items()}
    runnable = [step for step in steps if not lacking[step.index]]
    ran: set[int] = set()
    while runnable:
        step = runnable.pop()
        ran.add(step.index)
        for tensor in step.outputs.values():
            for reader in readers.pop(tensor, ()):
                lacking[reader.index] -= 1
                if not lacking[reader.index]:
                    runnable.append(reader)
    if len(ran) < len(steps):
        stuck = ", ".join(step.label for step in steps if step.index not in ran)
        raise ConfigError(f"ensemble '{name}' has a cycle: {stuck} wait on each other's outputs")
