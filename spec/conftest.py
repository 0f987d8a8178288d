"""Lets `pytest spec/ --backend NAME` (a path, from a checkout) load the suite's plugin too."""
pytest_plugins = ["padgraph.spec.plugin"]
