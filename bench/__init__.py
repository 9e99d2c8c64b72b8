"""Batchyard bench harness: load generation, demo and micro-benchmarks."""
