"""The transfer lifecycle: one transfer from its begin to its end (see docs/architecture.md)."""
