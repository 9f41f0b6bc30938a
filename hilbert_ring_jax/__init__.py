"""hilbert_ring_jax: LongNet dilated attention, Hilbert token orderings and ring attention in JAX."""

from .api import dilated_attention
from .decode import KVCache, dilated_attention_prefill, dilated_attention_step, init_kv_cache
from .merge import merge
from .nn import DilatedMultiHeadAttention, dilated_attention_fn
from .ordering import (hilbert_permutation, hilbert_permutation_per_segment,
                       inverse_permutation, serialize, unserialize)
from .pattern import DilatedPattern
from .reference import dilated_attention_reference
from .ring import ring_dilated_attention, sharded_dilated_attention, zigzag_positions
from . import linen  # hilbert_ring_jax.linen.DilatedMultiHeadAttention

__all__ = [
    "DilatedMultiHeadAttention",
    "DilatedPattern",
    "KVCache",
    "dilated_attention",
    "dilated_attention_fn",
    "dilated_attention_prefill",
    "dilated_attention_reference",
    "dilated_attention_step",
    "hilbert_permutation",
    "hilbert_permutation_per_segment",
    "init_kv_cache",
    "inverse_permutation",
    "linen",
    "merge",
    "ring_dilated_attention",
    "serialize",
    "sharded_dilated_attention",
    "unserialize",
    "zigzag_positions",
]

__version__ = "0.1.0"
