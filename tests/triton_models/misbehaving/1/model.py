"""y = 2x, except: a negative input is refused with an error response, an input whose first
element is 999 gets only the first half of its output columns, and one whose first element is 777
makes execute raise (Triton fails the call with the exception and its stack)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for req in requests:
            x = pb_utils.get_input_tensor_by_name(req, "x").as_numpy()
            if (x[:, 0] == 777).any():
                raise ValueError("seven hundred and seventy-seven")
            if (x < 0).any():
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input")))
                continue
            y = (x * 2).astype(np.float32)
            if (x[:, 0] == 999).any():
                y = y[:, :8]
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", y)]))
        return out
