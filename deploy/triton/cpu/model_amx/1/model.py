"""MiniLM-L6 in Triton's python backend, built by Batchyard's own factory.

The stub runs an isolated interpreter: it does not read PYTHONPATH, so the folders holding
torch/transformers and Batchyard are taken from BATCHYARD_SITE_PATHS (set by TritonLocal)."""

import os
import site

# addsitedir, not sys.path.append: it runs the folder's .pth files, which is how an editable
# install of Batchyard makes `batchyard` importable.
for p in os.environ.get("BATCHYARD_SITE_PATHS", "").split(os.pathsep):
    if p:
        site.addsitedir(p)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from batchyard.workers.models import minilm  # noqa: E402
from batchyard.workers.precision import torch_dtype  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        torch.set_num_threads(1)
        # The precision a Batchyard AMX worker takes by default on this CPU: bf16 where native.
        self.model = minilm().eval().to(torch_dtype("auto"))

    def execute(self, requests):
        out = []
        for req in requests:
            ids = torch.from_numpy(pb_utils.get_input_tensor_by_name(req, "input_ids").as_numpy().copy())
            mask = torch.from_numpy(pb_utils.get_input_tensor_by_name(req, "attention_mask").as_numpy().copy())
            with torch.inference_mode():
                emb = self.model(input_ids=ids, attention_mask=mask)["embedding"].float().numpy()
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("embedding", emb.astype(np.float32))]))
        return out
