import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def out(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.seen = []

    def attempt(self, label, function):
        try:
            function()
            self.seen.append([label, "ok"])
        except Exception as exc:
            self.seen.append([label, type(exc).__name__, str(exc)])

    def execute(self, requests):
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0].decode()
            if mode == "return_list":
                return [out(1) for _ in requests]
            self.answer(request, request.get_response_sender(), mode)
        return None

    def answer(self, request, sender, mode):
        if mode == "raise":
            sender.send(out(1))
            raise ValueError("probe boom")
        if mode == "error_midstream":
            sender.send(out(1))
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("mid", pb_utils.TritonError.INVALID_ARG)))
            sender.send(out(2))
            sender.send(flags=FINAL)
        elif mode == "error_final":
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("last words")), flags=FINAL)
        elif mode == "error_final_code":
            error = pb_utils.TritonError("bad", pb_utils.TritonError.INVALID_ARG)
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        elif mode == "final_with_response":
            sender.send(out(7), flags=FINAL)
        elif mode == "send_after_final":
            sender.send(out(1), flags=FINAL)
            self.attempt("send_after_final", lambda: sender.send(out(2)))
            self.attempt("final_after_final", lambda: sender.send(flags=FINAL))
        elif mode == "bad_flag":
            self.attempt("bad_flag", lambda: sender.send(out(1), flags=5))
            self.attempt("none_no_flag", lambda: sender.send(None))
            sender.send(flags=FINAL)
        elif mode == "zero":
            sender.send(flags=FINAL)
        elif mode == "thread":
            threading.Thread(target=self.produce, args=(sender,)).start()
        elif mode == "cancel_state":
            self.seen.append(["cancel_state", request.is_cancelled(), sender.is_cancelled()])
            sender.send(flags=FINAL)
        elif mode == "undeclared_output":
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("NOT_DECLARED", np.array([1], np.int32))]))
            sender.send(flags=FINAL)
        elif mode == "report":
            message = pb_utils.Tensor("MSG", np.array([json.dumps(self.seen)], dtype=object))
            sender.send(pb_utils.InferenceResponse([message]), flags=FINAL)
            self.seen = []

    @staticmethod
    def produce(sender):
        for value in range(3):
            time.sleep(0.01)
            sender.send(out(value))
        sender.send(flags=FINAL)
