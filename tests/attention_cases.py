"""Cases shared by the paged-attention and MLA interpreter tests."""
import torch

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


def random_tree_masks(bs, k, gen):
    """[bs, k, k] bool on the CPU: each draft token sees itself and the ancestors of a random parent."""
    masks = torch.zeros(bs, k, k, dtype=torch.bool)
    for r in range(bs):
        for i in range(k):
            masks[r, i, i] = True
            if i:
                parent = int(torch.randint(0, i, (), generator=gen))
                masks[r, i] |= masks[r, parent]
    return masks
