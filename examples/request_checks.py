"""The request checks, for examples/hf_llama.py: they live in `padgraph.llm.requests`."""
from padgraph.llm.requests import budget, prompt_ids  # noqa: F401
