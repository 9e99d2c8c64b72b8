"""Export MiniLM-L6 (Batchyard's factory: encoder + mean pooling + L2 norm) to
deploy/triton/gpu/model_gpu/1/model.onnx for Triton's ONNX Runtime backend (fp32; let
TensorRT/ORT pick fp16 on the GPU)."""

from pathlib import Path

import torch

from batchyard.workers.models import MINILM_SEQ, minilm

out = Path(__file__).parent / "model_gpu" / "1" / "model.onnx"
out.parent.mkdir(parents=True, exist_ok=True)
model = minilm().eval()
ids = torch.ones(2, MINILM_SEQ, dtype=torch.long)
torch.onnx.export(model, (ids, ids), str(out), input_names=["input_ids", "attention_mask"],
                  output_names=["embedding"], dynamic_axes={"input_ids": {0: "b"}, "attention_mask": {0: "b"},
                                                            "embedding": {0: "b"}}, opset_version=17)
print(f"wrote {out}")
