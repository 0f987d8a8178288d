"""Cases shared by the paged-attention and MLA interpreter tests."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from bench.common import random_tree_masks  # noqa: E402,F401  (the benchmarks' generator)

K_DRAFT = 4


def tree_masks(bs, pad_rows):
    """Request 0: a chain; others: a small tree (0 <- 1, 0 <- 2, 1 <- 3); padded rows: ones."""
    chain = torch.tril(torch.ones(K_DRAFT, K_DRAFT, dtype=torch.bool))
    tree = torch.eye(K_DRAFT, dtype=torch.bool)
    for child, parent in ((1, 0), (2, 0), (3, 1), (3, 0)):
        tree[child, parent] = True
    masks = torch.stack([chain if r == 0 else tree for r in range(bs)])
    masks[pad_rows] = True
    return masks
