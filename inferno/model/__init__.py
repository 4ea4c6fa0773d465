"""The model: the file checked against what the kernels compute (validate), the weights prepared once
and memory-mapped by later starts (prepared), one forward of every supported architecture over a
ragged batch (transformer, ragged), and the next token chosen from its logits (sampling)."""

from inferno.model.transformer import Transformer

__all__ = ["Transformer"]
