import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            parameters = json.loads(request.parameters())
            count = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            if parameters.get("style") == "thread":
                threading.Thread(target=self.count, args=(request, count, parameters.get("log"), True)).start()
            else:
                self.count(request, count, parameters.get("log"), False)
        return None

    def count(self, request, count, log, from_sender):
        sender = request.get_response_sender()
        outcome = f"finished {count}"
        for index in range(count):
            if sender.is_cancelled() if from_sender else request.is_cancelled():
                outcome = f"cancelled after {index}"
                break
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([index], np.int32))]))
            time.sleep(0.02)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if log:
            with open(log, "a") as file:
                file.write(outcome + "\n")
