"""Acceptance of a (target, draft) pair: the round chain, batch rounds, teacher forcing, acceptance statistics, the lossless checks, the prompts."""
