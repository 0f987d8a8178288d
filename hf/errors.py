"""padgraph.hf's errors: members of padgraph's ContractError family."""
from __future__ import annotations

import padgraph as pg


class UnsupportedModelError(pg.ContractValueError):
    """A model padgraph.hf cannot serve exactly (a layer with no attention interface), raised at
    `Decoder(...)` so that it never runs and gives wrong tokens."""


class NotBoundError(pg.ContractRuntimeError):
    """The padgraph attention function ran without the metadata a Decoder call passes."""


class ArgumentError(pg.ContractValueError):
    """An argument of a padgraph.hf entry point with a value it does not take."""


class ArgumentTypeError(pg.ContractTypeError):
    """An argument of a padgraph.hf entry point of a type it does not take."""
