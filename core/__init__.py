"""padgraph: fixed-shape GPU programs, fast and safe.

Declare a static program once (buffers, padded axes, a ladder of buckets, what each padded lane
holds), then lower it onto a backend: "cuda" (CUDA-graph capture and replay) or "reference"
(eager, the oracle). The padding contract is enforced for every runner; see spec/SPEC.md.
"""
from .axes import Affine, Axis
from .buckets import Buckets
from .capture import capturing
from .check import CheckResult, Finding, check
from . import distributed  # noqa: F401  pg.distributed: tensor-parallel helpers
from .errors import (BucketOverflowError, CanaryError, CaptureError, ContractAttributeError, ContractError, ContractKeyError,
                     ContractRuntimeError, ContractTypeError, ContractValueError, OverflowWarning, ShadowMismatch,
                     StaleOutputError, StateStorageError)
from .options import Options
from .pads import Edge, Fill
from .plan import Plan
from .program import Input, Output, Program, State
from .registry import backend_names, compile, register_backend
from .runtime import Outputs, Runner, Stats
from .shadow import Shadow
from .view import PaddedView

__version__ = "0.1.0"

__all__ = [
    "Affine", "Axis", "Buckets", "capturing", "check", "CheckResult", "Finding",
    "BucketOverflowError", "CanaryError", "CaptureError", "ContractAttributeError", "ContractError", "ContractKeyError", "ContractRuntimeError", "ContractTypeError",
    "ContractValueError", "OverflowWarning", "Shadow", "ShadowMismatch", "StaleOutputError", "StateStorageError", "Edge", "Fill", "Options", "Plan", "Input", "Output", "Program",
    "State", "backend_names", "compile", "register_backend", "Outputs", "Runner", "Stats", "PaddedView",
]
