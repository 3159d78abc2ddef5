"""The worker process of one python-backend model instance, as Triton's stub is.

Run by the backend as `python -m transerve.backends.python.worker --socket-fd N --input-fd A
--output-fd B`: it installs our `triton_python_backend_utils`, then serves the server's calls
(load, auto-complete, initialize, execute, is_ready, finalize) until finalize or until the server's
end of the socket closes.

A model with a plain `execute` runs on the main thread, one call at a time, in the order the calls
came. A model whose `execute` is a coroutine runs on an event loop: calls of a decoupled model run
concurrently, as in Triton, those of other models one at a time. Either way the model may call other
models (BLS) and a decoupled model may send responses from any thread (see channel.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import importlib
import inspect
import io
import itertools
import json
import mmap
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from transerve.backends.python import triton_python_backend_utils as pb_utils
from transerve.backends.python._pb_utils import link
from transerve.backends.python._pb_utils.responses import Outcome, _outcome
from transerve.backends.python.channel import Call, Channel
from transerve.backends.python.ipc import (
    OP_AUTO_COMPLETE,
    OP_EXECUTE,
    OP_FINALIZE,
    OP_INITIALIZE,
    OP_IS_READY,
    OP_LOAD,
    OP_REPLY,
    PENDING,
    RESCHEDULED,
    Endpoint,
)
from transerve.backends.python.shm import Entry, Region

#: A control reply: (None, value) on success, else ((error code name, one-line message), None).
Reply = tuple[tuple[str, str] | None, Any]
_DONE = (None, None, None)
_RESCHEDULED = (RESCHEDULED, None, None)
#: prctl(2): the signal a process gets when the thread that started it ends.
PR_SET_PDEATHSIG = 1
_SKIPPED = ("CANCELLED", "the request was cancelled before the model started it", None)


def _held_result(outcome: Outcome) -> tuple[Any, list[Entry]]:
    """A response's (result, outputs) for an execute's reply."""
    error, parameters, entries = outcome
    if error is not None:
        return (error[0], error[1], None), []
    return (None, None, parameters), entries


class ModelError(Exception):
    """A failure to report to the server as one line, with the error code it maps to."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def describe(exc: BaseException) -> str:
    """`ValueError: boom`, the one-line form the server puts in its error messages."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class ModelRunner:
    """Owns the user's TritonPythonModel and runs its lifecycle as the server asks."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.model_class: type | None = None
        self.model: Any = None
        self.model_name = ""
        self.instance_name = ""
        self.model_version = 0
        self.decoupled = False
        self._all_outputs: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Ids for non-decoupled responses sent after their execute's reply.
        self._late_ids = itertools.count(1)

    def load(self, spec: dict[str, str]) -> None:
        """Import `<version>/<file>` as Triton does: as module `<version>.<stem>`, with the version
        folder and the model folder on sys.path, so both `import helper` and `from . import helper`
        work from model.py."""
        self.model_name = spec["model_name"]
        self.instance_name = spec["instance_name"]
        self.model_version = int(spec["model_version"])
        model_file = Path(spec["model_file"])
        link._model_dir = str(model_file.parent)
        link._instance_name = self.instance_name
        sys.path.append(str(model_file.parent))
        sys.path.append(str(model_file.parent.parent))
        try:
            module = importlib.import_module(f"{model_file.parent.name}.{model_file.stem}")
        except BaseException as exc:
            traceback.print_exc()
            raise ModelError("INTERNAL", describe(exc)) from None
        model_class = getattr(module, "TritonPythonModel", None)
        if not isinstance(model_class, type):
            raise ModelError("INVALID_ARG", f"{model_file} does not define class TritonPythonModel")
        if not hasattr(model_class, "execute"):
            raise ModelError("INVALID_ARG", f"Python model {model_file} does not implement `execute` method.")
        self.model_class = model_class

    def auto_complete(self, config_json: str) -> str:
        config = pb_utils.ModelConfig(config_json)
        completer = getattr(self.model_class, "auto_complete_config", None)
        if completer is None:
            return config_json
        completed = self._call_model(completer, config)
        if not isinstance(completed, pb_utils.ModelConfig):
            raise ModelError(
                "INVALID_ARG",
                f"auto_complete_config function in model '{self.model_name}' "
                "must return a valid pb.ModelConfig object.",
            )
        return json.dumps(completed.as_dict())

    def initialize(self, args: dict[str, str]) -> bool:
        """Create the model and call its `initialize`; returns whether it defines `is_ready`."""
        assert self.model_class is not None
        config = json.loads(args["model_config"])
        self._all_outputs = [output["name"] for output in config.get("output", ())]
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        self.model = self._call_model(self.model_class)
        if hasattr(self.model, "initialize"):
            self._call_model(self.model.initialize, args)
        return hasattr(self.model, "is_ready")

    @property
    def async_execute(self) -> bool:
        return self.model is not None and inspect.iscoroutinefunction(self.model.execute)

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The worker's own loop, for `async def` methods."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    def _call_model(self, function: Any, *args: Any) -> Any:
        """Run model code, turning any exception into a one-line ModelError (traceback to stderr)."""
        try:
            return self._settle(function(*args))
        except ModelError:
            raise
        except BaseException as exc:
            traceback.print_exc()
            raise ModelError("INTERNAL", describe(exc)) from None

    def _settle(self, result: Any) -> Any:
        """Run a coroutine to completion on the worker's own event loop (`async def` methods)."""
        if type(result) is list or not asyncio.iscoroutine(result):  # a list, as usual: no ABC check
            return result
        return self.event_loop().run_until_complete(result)

    def requests(self, body: list[tuple[Any, ...]], groups: list[list[Entry]]) -> list[pb_utils.InferenceRequest]:
        """The pb_utils requests of an execute message: its metadata and its decoded input tensors."""
        received = pb_utils.InferenceRequest._received
        wrap = pb_utils.Tensor._wrap
        requests = []
        for (request_id, correlation_id, flags, parameters, requested, token, trace), inputs in zip(
                body, groups, strict=True):
            requests.append(
                received(
                    request_id,
                    correlation_id,
                    flags,
                    parameters,
                    self._all_outputs if requested is None else requested,
                    [wrap(name, datatype, data) for name, datatype, data in inputs],
                    self.model_name,
                    self.model_version,
                    token,
                    self.decoupled,
                    trace,
                )
            )
        tokens = [request._token for request in requests if request._token is not None]
        if tokens:
            self.channel.open_tokens(tokens)
        return requests

    def _live(self, requests: list[pb_utils.InferenceRequest]) -> list[pb_utils.InferenceRequest]:
        """The requests of a decoupled model to compute: one cancelled while it waited here is not. (Other models
        get every request, as in Triton, whose model sees `is_cancelled()`: reading the socket here would cost
        their fast path a system call per execute.)"""
        channel = self.channel
        channel.poll()
        if not channel.cancelled:
            return requests
        return [request for request in requests if request._token not in channel.cancelled]

    def execute(self, requests: list[pb_utils.InferenceRequest]) -> tuple[list[Any], list[list[Entry]]]:
        """Run one `execute` call: per request, its result and its output tensors.

        A result is (None, None, parameters), (error code name, message, None), (PENDING, id, None) for a
        response the model will send later under that id, or (RESCHEDULED, None, None); an exception (or a
        malformed return value) fails every request of the call, as in Triton.
        """
        try:
            live = self._live(requests) if self.decoupled else requests
            returned = self._settle(self.model.execute(live)) if live else None
            return self._results(requests, live, returned)
        except BaseException as exc:
            traceback.print_exc()
            return self.failed(requests, describe(exc))

    async def execute_async(self, requests: list[pb_utils.InferenceRequest]) -> tuple[list[Any], list[list[Entry]]]:
        """`execute` for a model whose `execute` is a coroutine, on the running loop."""
        try:
            live = self._live(requests) if self.decoupled else requests
            returned = await self.model.execute(live) if live else None
            return self._results(requests, live, returned)
        except BaseException as exc:
            traceback.print_exc()
            return self.failed(requests, describe(exc))

    def failed(self, requests: list[pb_utils.InferenceRequest], reason: str) -> tuple[list[Any], list[list[Entry]]]:
        """Every request of the call fails and its sender can send no more; a non-decoupled request whose one
        response was sent before the failure keeps it, as Triton's client gets that first response."""
        self.channel.close_tokens([request._token for request in requests if request._token is not None])
        if self.decoupled:
            return self.failure(len(requests), reason)
        results, outputs = self.failure(len(requests), reason)
        for index, request in enumerate(requests):
            held = request._sender._close() if request._sender is not None else None
            if held is not None:
                results[index], outputs[index] = _held_result(held)
        return results, outputs

    def failure(self, count: int, reason: str) -> tuple[list[Any], list[list[Entry]]]:
        message = (
            f"Failed to process the request(s) for model '{self.model_name}' "
            f"instance '{self.instance_name}', message: {reason}"
        )
        return [("INTERNAL", message, None)] * count, [[] for _ in range(count)]

    def _results(
        self, requests: list[pb_utils.InferenceRequest], live: list[pb_utils.InferenceRequest], returned: Any
    ) -> tuple[list[Any], list[list[Entry]]]:
        """Per request of the call: its result and outputs. A decoupled request cancelled before it started (not in
        `live`) ends with a CANCELLED error; a non-decoupled request that is answered can no longer be cancelled."""
        if self.decoupled:
            results, outputs = self._decoupled_results(live, returned)
        else:
            results, outputs = self._responses(live, self._check_responses(live, returned))
            done = [request._token for request, result in zip(live, results, strict=True)
                    if result[0] not in (PENDING, RESCHEDULED) and request._token is not None]
            if done:
                self.channel.close_tokens(done)
        if len(live) == len(requests):
            return results, outputs
        answered = iter(zip(results, outputs, strict=True))
        started = {id(request) for request in live}
        all_results: list[Any] = []
        all_outputs: list[list[Entry]] = []
        skipped = []
        for request in requests:
            if id(request) in started:
                result, output = next(answered)
            else:
                result, output = _SKIPPED, []
                skipped.append(request._token)
            all_results.append(result)
            all_outputs.append(output)
        self.channel.close_tokens(skipped)
        return all_results, all_outputs

    def _decoupled_results(
        self, requests: list[pb_utils.InferenceRequest], returned: Any
    ) -> tuple[list[Any], list[list[Entry]]]:
        """A decoupled model answers through its senders: `execute` must return None, as in Triton."""
        if returned is not None:
            raise TypeError(
                f"Python model '{self.instance_name}' is using the decoupled mode and the execute function "
                "must return None."
            )
        results: list[Any] = [
            _RESCHEDULED if request._release_flags == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE else _DONE
            for request in requests
        ]
        return results, [[] for _ in requests]

    @staticmethod
    def _check_responses(requests: list[pb_utils.InferenceRequest], returned: Any) -> list[Any]:
        """Reject what Triton rejects in execute's return value, as an error of the whole call. None means
        every request answers through its response sender (or is rescheduled)."""
        if returned is None:
            return [None] * len(requests)
        if not isinstance(returned, list):
            raise TypeError(f"Expected a list in the execute return, found type '{type(returned)}'.")
        if len(returned) != len(requests):
            raise ValueError(
                "Number of InferenceResponse objects do not match the number of InferenceRequest objects. "
                f"InferenceRequest(s) size is:{len(requests)}, and InferenceResponse(s) size is:{len(returned)}"
            )
        for request, response in zip(requests, returned, strict=True):
            if response is None:
                continue
            if request._release_flags == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
                raise TypeError(
                    "Expected a None object in the execute function return list for reschduled request, "
                    f"found type '{type(response)}'."
                )
            if not isinstance(response, pb_utils.InferenceResponse):
                raise TypeError(
                    "Expected an 'InferenceResponse' object in the execute function return list, "
                    f"found type '{type(response)}'."
                )
            if request._sender is not None:
                request._sender._returned()
        return returned

    def _responses(
        self, requests: list[pb_utils.InferenceRequest], responses: list[Any]
    ) -> tuple[list[Any], list[list[Entry]]]:
        """Per request: its result and its output tensors, pruned to the requested outputs as Triton does.
        A request answered with None is rescheduled, or answered through its sender: by the response it sent,
        or, if none yet, later (PENDING). One whose sender the model never took has no answer coming."""
        results: list[Any] = []
        outputs: list[list[Entry]] = []
        for request, response in zip(requests, responses, strict=True):
            if response is not None:
                result = _held_result(_outcome(response, request._requested_output_names))
            elif request._release_flags == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
                result = _RESCHEDULED, []
            elif request._sender is None:
                result = ("INTERNAL", f"model '{self.model_name}' returned no response for the request", None), []
            else:
                late = request._sender._reply(next(self._late_ids))
                result = ((PENDING, late, None), []) if isinstance(late, int) else _held_result(late)
            results.append(result[0])
            outputs.append(result[1])
        return results, outputs

    def is_ready(self) -> bool:
        try:
            return bool(self._settle(self.model.is_ready()))
        except Exception:
            traceback.print_exc()
            return False

    async def is_ready_async(self) -> bool:
        try:
            ready = self.model.is_ready()
            return bool(await ready if inspect.isawaitable(ready) else ready)
        except Exception:
            traceback.print_exc()
            return False

    def finalize(self) -> None:
        if self.model is not None and hasattr(self.model, "finalize"):
            try:
                self._settle(self.model.finalize())
            except Exception:
                traceback.print_exc()
        if self._loop is not None:
            self._loop.close()

    async def finalize_async(self) -> None:
        if self.model is not None and hasattr(self.model, "finalize"):
            try:
                finished = self.model.finalize()
                if inspect.isawaitable(finished):
                    await finished
            except Exception:
                traceback.print_exc()


def control(runner: ModelRunner, op: int, body: Any) -> Reply:
    """Answer a lifecycle message (everything but execute)."""
    try:
        if op == OP_LOAD:
            return None, runner.load(body)
        if op == OP_AUTO_COMPLETE:
            return None, runner.auto_complete(body)
        if op == OP_INITIALIZE:
            return None, runner.initialize(body)
        if op == OP_IS_READY:
            return None, runner.is_ready()
        if op == OP_FINALIZE:
            return None, runner.finalize()
    except ModelError as exc:
        return (exc.code, exc.message), None
    return ("INTERNAL", f"unknown message {op}"), None


def reply_execute(
    runner: ModelRunner,
    call_id: int,
    requests: list[pb_utils.InferenceRequest],
    results: list[Any],
    outputs: list[list[Entry]],
    timings: tuple[int, int],
) -> None:
    """Send an execute's reply: ((results, (input, infer, output) ns), outputs), timing the output step."""
    received_ns, built_ns = timings
    executed_ns = time.perf_counter_ns()

    def build(endpoint: Endpoint) -> tuple[bytes, list[int]]:
        nonlocal results
        try:
            placed = endpoint.place(outputs)
        except Exception as exc:  # e.g. no memory for a one-off region
            traceback.print_exc()
            results, _ = runner.failure(len(requests), f"cannot return the outputs: {describe(exc)}")
            placed = endpoint.place(())
        spent = (built_ns - received_ns, executed_ns - built_ns, time.perf_counter_ns() - executed_ns)
        return endpoint.encode(OP_REPLY, call_id, (results, spent), placed)

    runner.channel.send_encoded(build)


def serve(channel: Channel, runner: ModelRunner) -> None:
    """Answer the server's calls until finalize or until the server goes away; a model whose
    `execute` is a coroutine continues on its event loop once initialized."""
    while True:
        call = channel.next_call()
        if call is None:
            runner.finalize()
            return
        received_ns = time.perf_counter_ns()
        op, call_id, body, groups = call
        if op == OP_EXECUTE:
            requests = runner.requests(body, groups)
            del groups
            built_ns = time.perf_counter_ns()
            results, outputs = runner.execute(requests)
            reply_execute(runner, call_id, requests, results, outputs, (received_ns, built_ns))
            continue
        reply = control(runner, op, body)
        channel.send(OP_REPLY, call_id, reply)
        if op == OP_FINALIZE:
            return
        if op == OP_INITIALIZE and reply[0] is None and runner.async_execute:
            serve_on_loop(channel, runner)
            return


def serve_on_loop(channel: Channel, runner: ModelRunner) -> None:
    """Serve an `async def execute` model on its event loop, which reads the socket whenever it is
    readable: a decoupled model's executes run concurrently (Triton 24.04+), others one at a time."""
    loop = runner.event_loop()
    asyncio.set_event_loop(loop)
    one_at_a_time = contextlib.nullcontext() if runner.decoupled else asyncio.Lock()
    tasks: set[asyncio.Task[None]] = set()
    scheduled = False

    async def execute(call_id: int, body: Any, groups: list[list[Entry]]) -> None:
        async with one_at_a_time:
            received_ns = time.perf_counter_ns()
            requests = runner.requests(body, groups)
            built_ns = time.perf_counter_ns()
            results, outputs = await runner.execute_async(requests)
            reply_execute(runner, call_id, requests, results, outputs, (received_ns, built_ns))

    async def is_ready(call_id: int) -> None:
        channel.send(OP_REPLY, call_id, (None, await runner.is_ready_async()))

    async def finalize(call_id: int | None) -> None:
        await runner.finalize_async()
        if call_id is not None:
            channel.send(OP_REPLY, call_id, (None, None))
        loop.stop()

    def start(call: Call) -> None:
        if call is None:
            coroutine = finalize(None)
        else:
            op, call_id, body, groups = call
            if op == OP_EXECUTE:
                coroutine = execute(call_id, body, groups)
            elif op == OP_IS_READY:
                coroutine = is_ready(call_id)
            elif op == OP_FINALIZE:
                coroutine = finalize(call_id)
            else:
                channel.send(OP_REPLY, call_id, (("INTERNAL", f"unexpected message {op}"), None))
                return
        task = loop.create_task(coroutine)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def start_calls() -> None:
        nonlocal scheduled
        scheduled = False
        for call in channel.take_calls():
            start(call)

    def on_call() -> None:
        nonlocal scheduled
        if not scheduled:
            scheduled = True
            loop.call_soon(start_calls)

    channel.hold_for_loop(loop, on_call)
    loop.add_reader(channel.fileno(), channel.poll)
    start_calls()
    try:
        loop.run_forever()
    finally:
        loop.remove_reader(channel.fileno())
        loop.close()


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this worker when the server dies, however it dies (SIGKILL included), so no worker
    outlives it. A server that died before the request took effect is seen as a changed parent pid."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the closed socket still ends the worker, between calls
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket-fd", type=int, required=True, help="the SOCK_SEQPACKET end to serve")
    parser.add_argument("--input-fd", type=int, required=True, help="memfd of the server-to-worker arena")
    parser.add_argument("--output-fd", type=int, required=True, help="memfd of the worker-to-server arena")
    parser.add_argument("--log-settings-fd", type=int, help="memfd of the server's log settings page")
    parser.add_argument("--parent-pid", type=int, help="the server's pid: exit with it")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    # Triton's stub embeds the interpreter without arguments, so models see `sys.argv == [""]`; models that run
    # `unittest.main(...)` parse it and would reject the worker's own options.
    sys.argv = [""]
    # The server decides when its workers stop (each leads a session of its own, out of the terminal's reach).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # stdout is a pipe to the server's log: a model's prints reach it line by line, as on a terminal.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    # `python -m` puts the working directory first on sys.path; a Triton stub has no such entry.
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    sys.modules["triton_python_backend_utils"] = pb_utils
    sock = socket.socket(fileno=args.socket_fd)
    endpoint = Endpoint(outgoing=Region.attach(args.output_fd), incoming=Region.attach(args.input_fd))
    channel = Channel(sock, endpoint)
    link._channel = channel
    if args.log_settings_fd is not None:
        pb_utils.Logger.settings_page = mmap.mmap(args.log_settings_fd, mmap.PAGESIZE, access=mmap.ACCESS_READ)
        os.close(args.log_settings_fd)
    serve(channel, ModelRunner(channel))


if __name__ == "__main__":
    main()
