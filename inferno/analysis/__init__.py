"""Analysis: what a cache holds and where attention goes (cache_view, kv-inspect), how far another
element type's logits drift from float32 (fidelity), a text's perplexity through a cache
(perplexity), the per-token log (token_log), and the figures (plots)."""
