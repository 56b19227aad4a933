"""Choosing k: the marginal-cost table, k per batch size, the vLLM table, the serving simulation and its validation."""
