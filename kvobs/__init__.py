"""kvobs: safety and observability for KV-cache transfers (prefetch, write-back, send)."""

__version__ = "0.1.0"
