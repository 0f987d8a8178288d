"""The CUDA-graph backend: `pg.compile(program, body, backend="cuda")`."""
from .runner import CudaGraphRunner

__all__ = ["CudaGraphRunner"]
