"""The gate's decision per variant and slice, its table and gate-check's exit status."""
