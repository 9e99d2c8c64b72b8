"""Python-backend test model: y = tanh(x @ W) with a fixed seeded W (1024x1024), numpy only,
so it runs on a CPU-only host. Deterministic: tests compare Batchyard's path with calling
Triton directly."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.w = (np.random.default_rng(0).standard_normal((1024, 1024)) / 32.0).astype(np.float32)

    def execute(self, requests):
        out = []
        for req in requests:
            x = pb_utils.get_input_tensor_by_name(req, "x").as_numpy()
            y = np.tanh(x @ self.w).astype(np.float32)
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", y)]))
        return out
