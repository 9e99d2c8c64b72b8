"""Batchyard: a multi-process inference dispatcher (dispatcher process, protocol, client SDK)."""

__version__ = "0.1.0"
