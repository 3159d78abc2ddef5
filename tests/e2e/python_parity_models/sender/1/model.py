"""Answers through `get_response_sender()` as MODE says ("none": returns None and never takes the sender).

OUT tells where the response came from: 1 sent before `execute` returned, 2 returned from it, 3 sent after it
returned (from a thread, or a task of the worker's loop)."""

import asyncio
import contextlib
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def response(where):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([where], np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self._async = parameters["ASYNC"]["string_value"] == "1"
        self._tasks = set()
        if self._async:
            self.execute = self._execute_async

    def execute(self, requests):
        return self._answer(requests)

    async def _execute_async(self, requests):
        return self._answer(requests)

    def _answer(self, requests):
        returned = []
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0].decode()
            sender = request.get_response_sender() if mode not in ("on", "none") else None
            if mode in ("pre", "pre_and_on"):
                sender.send(response(1), flags=FINAL)
            elif mode == "pre_then_final":
                sender.send(response(1))
                sender.send(flags=FINAL)
            elif mode == "two_pre":
                sender.send(response(1))
                sender.send(response(1))  # raises: one response only
            elif mode == "zero_pre":
                sender.send(flags=FINAL)  # raises: nothing was sent
            elif mode in ("post", "on_and_post"):
                self._later(sender, response(3))
            elif mode == "error_post":
                error = pb_utils.TritonError("failed after returning", pb_utils.TritonError.INVALID_ARG)
                self._later(sender, pb_utils.InferenceResponse(error=error))
            returned.append(response(2) if mode in ("on", "pre_and_on", "on_and_post") else None)
        return None if all(item is None for item in returned) else returned

    def _later(self, sender, answer):
        def send():
            with contextlib.suppress(pb_utils.TritonModelException):  # on_and_post: the returned one was it
                sender.send(answer, flags=FINAL)

        if self._async:
            async def task():
                await asyncio.sleep(0.2)
                send()

            running = asyncio.get_running_loop().create_task(task())
            self._tasks.add(running)
            running.add_done_callback(self._tasks.discard)
        else:
            threading.Thread(target=lambda: (time.sleep(0.2), send()), daemon=True).start()
