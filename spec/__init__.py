"""padgraph.spec: SPEC.md (the contract as numbered rules) and the conformance suite.

Run it on a backend with `python -m padgraph.spec --backend NAME` (see SPEC.md).
"""
import os

SPEC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "SPEC.md")
