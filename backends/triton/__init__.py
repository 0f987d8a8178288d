"""Triton kernels of padgraph's programs; importing them starts Triton's once-per-process setup
in a background thread on CUDA machines (see `prewarm`)."""
from . import prewarm

prewarm.start()
