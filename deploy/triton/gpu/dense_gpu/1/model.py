"""Python-backend test model for GPU hosts: y = tanh(x @ W) with dense_amx's seeded W, in fp32
on the instance's GPU. Inputs arrive as GPU tensors where Triton has them there (CUDA shared
memory) and outputs leave as GPU tensors; an input in host memory is copied to the GPU.

The stub runs an isolated interpreter: torch's folder comes from BATCHYARD_SITE_PATHS (set by
TritonLocal)."""

import os
import site

for p in os.environ.get("BATCHYARD_SITE_PATHS", "").split(os.pathsep):
    if p:
        site.addsitedir(p)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from torch.utils.dlpack import from_dlpack, to_dlpack  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.device = torch.device("cuda", int(args["model_instance_device_id"]))
        w = (np.random.default_rng(0).standard_normal((1024, 1024)) / 32.0).astype(np.float32)
        self.w = torch.from_numpy(w).to(self.device)

    def execute(self, requests):
        out = []
        for req in requests:
            x = from_dlpack(pb_utils.get_input_tensor_by_name(req, "x").to_dlpack()).to(self.device)
            with torch.inference_mode():
                y = torch.tanh(x @ self.w)
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor.from_dlpack("y", to_dlpack(y))]))
        return out
