"""Graph-safe paged attention kernels (decode, extend, tree verify) and their torch references.

Every public function takes `impl="auto"|"triton"|"torch"`: "auto" runs Triton when the tensors
are on CUDA, else the torch reference. `sm_scale=None` means `head_dim ** -0.5`; outputs have
q's dtype and are accumulated in fp32. KV layout and sinks: see `kv.py`. Under `torch.compile`
the three are opaque custom ops (`compile_ops.py`).
"""
from . import attention_decode, attention_extend, attention_verify
from .attention_decode import choose_num_splits, decode_attention_reference
from .attention_extend import extend_attention_reference
from .attention_verify import tree_verify_attention_reference
from .compile_ops import opaque_under_compile

# opaque custom ops under torch.compile (see compile_ops.py); the functions themselves eagerly
decode_attention = opaque_under_compile(attention_decode.decode_attention)
extend_attention = opaque_under_compile(attention_extend.extend_attention)
tree_verify_attention = opaque_under_compile(attention_verify.tree_verify_attention)

__all__ = [
    "decode_attention", "decode_attention_reference",
    "extend_attention", "extend_attention_reference",
    "tree_verify_attention", "tree_verify_attention_reference",
    "choose_num_splits",
]
