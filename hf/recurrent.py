"""Recurrent state of hybrid models: the convolution windows and SSM / delta-net states HF's
mixers keep across tokens, held in the Target's recurrent pools (`cache.PagedCache`) and handed
to the mixers as the cache object they expect.

transformers' hybrid mixers (Mamba, Mamba2, Bamba, Jamba, FalconH1, GraniteMoeHybrid, NemotronH,
LFM2's short convolutions, Qwen3-Next's gated delta net, ...) read and write their state only
through their cache's linear-attention API: `get_conv_state` / `update_conv_state` (a causal
convolution's last `kernel` inputs, `[C, kernel]` a request) and `get_recurrent_state` /
`update_recurrent_state` (the SSM or delta-rule state), per `(layer_idx, state_idx)`. `Step` is
that API over batch-ordered tensors: the forward that runs the mixers gets one `Step` as its
`cache`, HF's own code computes and writes the states exactly as under `generate`, and the caller
moves the rows between the pool and the `Step`:

    prefill   `Step.fresh`: zero rows, no previous state (HF's first forward: the conv window is
              the left-padded prompt's last `kernel` inputs, the scan starts from zero); the rows
              it leaves are copied into the requests' slots (`scatter`)
    decode    `Step.gathered`: a convolution window is each lane's slot row read from the pool
              (`index_select`), updated in place by the mixers' single-token paths, written
              back to the same slots (`index_copy_`); a recurrent (SSM / delta-rule) state is
              read from the pool where the mixer asks for it and written straight into the
              lanes' slots by its `update_recurrent_state`, inside the mixer's code (in a
              compiled layer, inductor may fuse both with it: no batch-ordered copy of the
              state outside the layers, no scatter after the forward). Fixed shapes per
              bucket, device indices, no host sync

The pools hold one tensor per state, `[n_req_rows, *shape]`, indexed by padgraph.llm's request
row: row 0 is the sink, a padded lane's (request row 0) read and write; request row r owns row r
from its admission to its release. A request's first forward (its prefill) never reads its row:
the old occupant's state is overwritten whole, never read into arithmetic.

Attention layers that receive the `Step` (HF passes one cache to every layer) see a cache that
stores nothing: `update` hands keys and values back, padgraph's attention function keeps them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CONV, RECURRENT = "conv", "recurrent"


@dataclass(frozen=True)
class StateSpec:
    """One recurrent state of one layer: `kind` conv (`shape[-1]` is the kernel) or recurrent,
    HF's `state_idx` within the layer, its per-request shape and dtype."""

    layer_idx: int
    kind: str
    state_idx: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def key(self) -> tuple[int, str, int]:
        return self.layer_idx, self.kind, self.state_idx


class Step:
    """HF's linear-attention cache API over batch-ordered rows `[b, *spec.shape]`, one per spec,
    for one forward. `fresh`: the forward is the requests' first (prefill): no previous state is
    read, and a conv window shorter than its kernel is left-padded with zeros, as HF's first
    forward does. Otherwise each state is read and rewritten in place."""

    is_compileable = False          # HF's mask builders: no static-cache shortcut

    def __init__(self, specs: tuple[StateSpec, ...], rows: list[torch.Tensor | None], fresh: bool,
                 pool: list[torch.Tensor] | None = None, slots: torch.Tensor | None = None):
        self.specs, self.rows, self.fresh = specs, rows, fresh
        self.pool, self.slots = pool, slots      # a continuing forward: the recurrent states' home
        self.at = {s.key: i for i, s in enumerate(specs)}

    @classmethod
    def fresh_rows(cls, specs: tuple[StateSpec, ...], n: int, device) -> "Step":
        """Zero rows for n requests' first forward."""
        return cls(specs, [torch.zeros(n, *s.shape, dtype=s.dtype, device=device) for s in specs], fresh=True)

    @classmethod
    def gathered(cls, specs: tuple[StateSpec, ...], pool: list[torch.Tensor], slots: torch.Tensor) -> "Step":
        """A continuing forward over the slots' rows of the pool (slots [b] int64 on the pool's
        device): the convolution windows gathered now, the recurrent states read and written in
        the pool where the mixers ask (module doc)."""
        rows = [t.index_select(0, slots) if s.kind == CONV else None for s, t in zip(specs, pool)]
        return cls(specs, rows, fresh=False, pool=pool, slots=slots)

    def scatter(self, pool: list[torch.Tensor], slots: torch.Tensor) -> None:
        """Each batch-ordered row back into its slot of the pool (slots [b]; padded lanes: the
        sink); a continuing forward's recurrent states are there already."""
        for t, r in zip(pool, self.rows):
            if r is not None:
                t.index_copy_(0, slots, r)

    def _row(self, layer_idx: int, kind: str, state_idx: int) -> torch.Tensor:
        return self.rows[self.at[(layer_idx, kind, state_idx)]]

    # ---- HF's Cache API, the part its recurrent mixers call -----------------------------------------
    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return None if self.fresh else self._row(layer_idx, CONV, state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """conv_states [b, C, t] the new inputs -> [b, C, max(t, kernel)] (fresh) or [b, C, kernel + t]:
        the window the causal convolution reads; its last `kernel` columns are kept."""
        row = self._row(layer_idx, CONV, state_idx)                                    # [b, C, kernel]
        kernel = row.shape[-1]
        if self.fresh:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([row, conv_states], dim=-1)
        row.copy_(full[..., -kernel:])
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        """None in a first forward; else the lanes' states, read from the pool (a new tensor:
        HF's mixers clone it or compute a new one, and hand that to `update_recurrent_state`)."""
        if self.fresh:
            return None
        return self.pool[self.at[(layer_idx, RECURRENT, state_idx)]].index_select(0, self.slots)

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs) -> torch.Tensor:
        last = recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1]
        if self.fresh:
            row = self._row(layer_idx, RECURRENT, state_idx)
            row.copy_(last)
            return row
        pool = self.pool[self.at[(layer_idx, RECURRENT, state_idx)]]
        pool.index_copy_(0, self.slots, last.to(pool.dtype))     # padded lanes: the sink
        return last

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return not self.fresh

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0            # no rollback: only the last state is kept

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """HF counts decoded tokens here; padgraph's positions come from the program's inputs."""

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """An attention layer's keys and values, handed back: padgraph's attention stores them."""
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._prefill_only("get_seq_length", 0)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._prefill_only("get_query_offset", 0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._prefill_only("get_mask_sizes", (query_length, 0))

    def _prefill_only(self, what: str, value):
        """What HF's cache counts from the tokens it has seen: nothing before a first forward;
        after it, padgraph passes positions and masks itself and keeps no count."""
        if not self.fresh:
            raise NotImplementedError(f"padgraph.hf's recurrent cache keeps no token count: the model called "
                                      f"cache.{what} in a decode step")
        return value


class Recording(Step):
    """A fresh `Step` that makes each state's row on first use and records its spec: which
    layers keep state through HF's cache API, with which shapes (`survey` in support.py)."""

    def __init__(self):
        super().__init__((), [], fresh=True)
        self.seen: list[StateSpec] = []

    def _make(self, spec: StateSpec, b: int, device) -> None:
        if spec.key not in self.at:
            self.at[spec.key] = len(self.rows)
            self.rows.append(torch.zeros(b, *spec.shape, dtype=spec.dtype, device=device))
            self.seen.append(spec)

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        if conv_kernel_size is None:
            raise NotImplementedError(f"layer {layer_idx} updates a conv state without its kernel size "
                                      f"(conv_kernel_size): its window cannot be sized ahead")
        spec = StateSpec(layer_idx, CONV, state_idx, (*conv_states.shape[1:-1], int(conv_kernel_size)),
                         conv_states.dtype)
        self._make(spec, conv_states.shape[0], conv_states.device)
        return super().update_conv_state(conv_states, layer_idx, state_idx, conv_kernel_size, **kwargs)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        last = recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1]
        self._make(StateSpec(layer_idx, RECURRENT, state_idx, tuple(last.shape[1:]), last.dtype),
                   last.shape[0], last.device)
        return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)


def cache_argument(model) -> str:
    """The keyword through which the model's forward takes its cache: transformers 5's `cache`,
    else `past_key_values`."""
    import inspect
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "cache"
    return "cache" if "cache" in params else "past_key_values"
