"""Example models for padgraph: a Llama-like target and an EAGLE draft head over paged KV."""
