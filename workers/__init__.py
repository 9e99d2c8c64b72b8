"""Batchyard worker processes: AMX (PyTorch bf16 on CPU) and simulated devices."""
