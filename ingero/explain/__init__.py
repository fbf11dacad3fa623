"""Explain engine: per-op statistics and the rules that build causal chains."""
