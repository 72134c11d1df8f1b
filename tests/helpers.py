"""Small test helpers."""

from diloco_eqx.profiling import count_compilations

__all__ = ["count_compilations"]
