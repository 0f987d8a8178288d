"""The one batch value a model forward takes besides its tokens and positions.

A runner's body builds it from its padded view (`Batch.from_view(x)`), an eager caller from its
own tensors; models read the fields they need (`forward_decode(input_ids, positions, batch)`,
as SGLang's `forward(input_ids, positions, forward_batch)`). Every field is a padded static
tensor inside a runner program, so the pad values of the declaration (`seq_lens` 1,
`out_cache_loc` the sink slot 0, `req_pool_indices` the reserved row 0) are what padded lanes
carry here too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

# a runner's state name -> the attribute models read on `batch.kv`
CACHE_NAMES = {"k_cache": "k", "v_cache": "v", "latent_cache": "latent",
               # a hybrid target's recurrent pools and a verify's per-node states
               "conv_state": "conv", "ssm_state": "ssm", "tree_conv": "tree_conv",
               "tree_ssm": "tree_ssm"}


class Caches:
    """The bound caches as the models read them (`kv.k`, `kv.v` or `kv.latent`, per layer); a
    plain class, which torch.compile traces (a SimpleNamespace it does not)."""

    def __init__(self, caches: dict):
        for attr, value in caches.items():      # setattr: dynamo traces it
            setattr(self, attr, value)


def caches_of(x) -> Caches:
    """The caches bound to a runner's view `x` (or a `RawView`), by the models' names."""
    return Caches({attr: x[name] for name, attr in CACHE_NAMES.items() if name in x})


class RawView(dict):
    """Raw tensors and bound state by name, read as a body reads its view (`x.name`, `x[name]`):
    for calling a runner's body eagerly at the raw sizes."""
    __getattr__ = dict.__getitem__


@dataclass(frozen=True)
class Batch:
    """Where a forward's new K/V go and what its queries attend to.

    `kv` holds the per-layer caches (`kv.k[i]`, `kv.v[i]`, or `kv.latent[i]`: a `KVCache`, a
    `LatentCache`, or a runner's bound `Caches`). `qo_indptr` is set for packed extends (prefill,
    draft-extend), `tree_mask` for tree attention (verify, a draft step).
    """
    kv: Any
    req_to_token: Tensor            # [n_rows, max_context] int32 (row, position) -> slot
    req_pool_indices: Tensor        # [bs] int32 each request's row (0: the sink row)
    seq_lens: Tensor                # [bs] int32 KV length once this call's tokens are in
    out_cache_loc: Tensor           # [n_tok] int64 slot of each new token (0: the sink slot)
    qo_indptr: Tensor | None = None     # [bs + 1] int32 request r's tokens: [qo[r], qo[r+1])
    tree_mask: Tensor | None = None     # [bs, k, k] bool (True: attend) over a request's tree
    impl: str = "auto"              # attention: "auto" | "triton" | "torch"

    @classmethod
    def from_view(cls, x, **overrides) -> "Batch":
        """The batch of a runner's padded view `x` (its bound caches and metadata inputs);
        `overrides` replace fields the body computes (verify's `seq_lens + k`, a draft step's
        mask and slots)."""
        fields = dict(kv=caches_of(x), req_to_token=x["req_to_token"],
                      req_pool_indices=x["req_pool_indices"], seq_lens=x["seq_lens"],
                      out_cache_loc=x["out_cache_loc"],
                      qo_indptr=x["qo_indptr"] if "qo_indptr" in x else None,
                      tree_mask=x["tree_mask"] if "tree_mask" in x else None)
        fields.update(overrides)
        return cls(**fields)
