"""Acceptance of a (target, draft) pair: the round chain, teacher forcing, acceptance statistics, the lossless checks, the prompts."""
