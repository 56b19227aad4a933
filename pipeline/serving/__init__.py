"""Choosing k: the marginal-cost table from specq's B = 1 timing, the pooled timing noise behind its
intervals, and k from vLLM's measurements (B = 1 and each closed-loop concurrency)."""
