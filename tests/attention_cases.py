"""Cases shared by the paged-attention and MLA interpreter tests."""

import torch


K_DRAFT = 4


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


def tree_masks(bs, pad_rows):
    """Request 0: a chain; others: a small tree (0 <- 1, 0 <- 2, 1 <- 3); padded rows: ones."""
    chain = torch.tril(torch.ones(K_DRAFT, K_DRAFT, dtype=torch.bool))
    tree = torch.eye(K_DRAFT, dtype=torch.bool)
    for child, parent in ((1, 0), (2, 0), (3, 1), (3, 0)):
        tree[child, parent] = True
    masks = torch.stack([chain if r == 0 else tree for r in range(bs)])
    masks[pad_rows] = True
    return masks


# ----------------------------------------------------------------------------- split merges

def n_used_of(seq_lens, num_splits, block_n):
    """Non-empty splits of each request (`attention_split.split_len`): [bs] int64."""
    lens = seq_lens.long()
    share = torch.clamp((-(-(-(-lens // num_splits)) // block_n)) * block_n, min=block_n)
    return -(-lens // share)


def merge_case(n_rows, n_heads, num_splits, v_head_dim, n_used, seed=0):
    """Partials as the split kernels leave them (`attention_split.partials`, padded strides), for
    `n_used` non-empty splits per row (an int or [n_rows]): random (o, lse) on splits < n_used,
    NaN past them (a merge that reads them turns NaN). Row 1 saw nothing in any split (lse -inf,
    o 0: its merge gives 0); row 2 saw nothing in every third split."""
    from padgraph.backends.triton.attention_split import partials
    gen = torch.Generator().manual_seed(seed)
    n_used = torch.as_tensor(n_used).expand(n_rows)
    mid_o, mid_lse = partials(n_rows, n_heads, num_splits, v_head_dim, "cpu")
    mid_o.copy_(torch.randn(mid_o.shape, generator=gen))
    mid_lse.copy_(3 * torch.randn(mid_lse.shape, generator=gen))
    empty = torch.zeros(n_rows, num_splits, dtype=torch.bool)
    if n_rows > 1:
        empty[1] = True
    if n_rows > 2:
        empty[2, ::3] = True
    mid_lse.masked_fill_(empty[:, None, :], float("-inf"))
    mid_o.masked_fill_(empty[:, None, :, None], 0.0)
    past = torch.arange(num_splits)[None, :] >= n_used[:, None]  # [n_rows, S]
    mid_lse.masked_fill_(past[:, None, :], float("nan"))
    mid_o.masked_fill_(past[:, None, :, None], float("nan"))
    return mid_o, mid_lse


def merge_reference(mid_o, mid_lse, n_used):
    """fp64 log-sum-exp merge of each row's first n_used[row] splits -> [n_rows, H, DV]; rows
    that saw nothing give 0."""
    out = torch.zeros(mid_o.shape[0], mid_o.shape[1], mid_o.shape[3], dtype=torch.float64)
    for r, n in enumerate(n_used.tolist()):
        lse = mid_lse[r, :, :n].double()  # [H, n]
        m = lse.max(dim=1, keepdim=True).values
        w = torch.exp(lse - torch.where(m > float("-inf"), m, 0.0))  # [H, n]; -inf -> 0
        num = (w[:, :, None] * mid_o[r, :, :n].double()).sum(dim=1)
        den = w.sum(dim=1, keepdim=True)
        out[r] = num / torch.where(den > 0, den, 1.0)
    return out
