"""What the worker asks of a model, as `typing.Protocol`s (structural: a model need not inherit
anything). Every forward takes padded static tensors and one `Batch`, syncs nothing with the
host and makes no data-dependent shape, so it can run inside a captured graph.

Optional on a target: `forward_verify_hidden(input_ids, positions, batch) -> hidden` with
`greedy_ids(hidden) -> ids` (verify without writing [n, V] fp32 logits), and
`new_cache(n_layers, n_slots, max_context, n_req_rows)` returning its own cache (an object with
`req_to_token` and `state()`, the bound tensors by state name); without it the worker allocates
K/V pools of `cfg` (`n_kv_heads`, `head_dim`). `new_draft_cache(n_slots)` returns the draft
head's one-layer cache where the head's layer is not of the target's own kind (`padgraph.hf.Target`:
K/V pools beside its per-call cache). A target served without a draft head may return None for
`hidden` (nothing reads it). `extend_in_graph = False` says its `forward_extend` reads the host
(it runs only eagerly): the worker then refuses `prefill="runner"`.

A target with recurrent layers (`padgraph.llm.models.hybrid`) adds
`new_hybrid_cache(n_slots, max_context, n_req_rows, tree_nodes)`: its K/V and recurrent pools
(sink row 0, a request's recurrent row its request row) and room for the state after each of a
verify's `tree_nodes` nodes a request; and `commit_tree(batch, last_node)`, which the verify body
calls with each request's accepted path's last node [bs] so its row holds the state after the
accepted tokens (on the device, no sync). `forward_decode_greedy(input_ids, positions, batch) ->
(ids, top-2 gap, hidden)` is taken by greedy-only decode programs where present.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from .batch import Batch


@runtime_checkable
class TargetModel(Protocol):
    """The model being served: paged forwards returning `(logits fp32, hidden)`; `hidden` is the
    final-normed state the draft head reads. `cfg` has `n_layers` and `vocab_size`; `layers` are
    the decoder layers (compiled regionally); `lm_head.weight` gives dtype and device."""
    cfg: Any
    layers: nn.ModuleList
    lm_head: nn.Linear

    def forward_decode(self, input_ids: Tensor, positions: Tensor, batch: Batch
                       ) -> tuple[Tensor, Tensor]:
        """[bs] tokens → (logits [bs, V], hidden [bs, H])."""

    def forward_extend(self, input_ids: Tensor, positions: Tensor, batch: Batch
                       ) -> tuple[Tensor, Tensor]:
        """Packed [n_tok] tokens (`batch.qo_indptr`) → (logits of each request's last token
        [bs, V], hidden [n_tok, H])."""

    def forward_extend_hidden(self, input_ids: Tensor, positions: Tensor, batch: Batch) -> Tensor:
        """`forward_extend`'s hidden [n_tok, H] only (the prefill program)."""

    def forward_verify(self, input_ids: Tensor, positions: Tensor, batch: Batch
                       ) -> tuple[Tensor, Tensor]:
        """[bs*k] tree tokens (`batch.tree_mask`, seq_lens = prefix + k) → (logits, hidden)."""

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [n, H] → fp32 logits [n, V]."""


@runtime_checkable
class DraftModel(Protocol):
    """A draft head (EAGLE, MTP): pairs (token p+1, target hidden p) → a hidden standing in for
    the target's at p+1; `layer` is its one decoder layer (compiled regionally)."""
    layer: nn.Module

    def forward_extend(self, input_ids: Tensor, hidden: Tensor, positions: Tensor,
                       batch: Batch) -> Tensor:
        """Packed [n_tok] pairs → the head's hidden [n_tok, H]."""

    def forward_draft_step(self, step: int, input_ids: Tensor, hidden: Tensor,
                           positions: Tensor, batch: Batch) -> Tensor:
        """Draft step `step`'s topk nodes per request [bs*topk] → hidden [bs*topk, H]."""

    def topk(self, hidden: Tensor, topk: int) -> tuple[Tensor, Tensor]:
        """(probs [n, topk] fp32, token ids [n, topk] int64) of the draft distribution."""
