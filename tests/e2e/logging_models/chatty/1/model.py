"""Logs one line at each level per execution, numbered, so a test can see which levels the settings let through."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.executions = 0

    def execute(self, requests):
        self.executions += 1
        logger = pb_utils.Logger
        logger.log_info(f"chatty-info-{self.executions}")
        logger.log_warn(f"chatty-warning-{self.executions}")
        logger.log_error(f"chatty-error-{self.executions}")
        logger.log_verbose(f"chatty-verbose-{self.executions}")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([self.executions], np.int32))])
                for _ in requests]
