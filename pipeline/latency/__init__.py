"""Measured decode time: the plain grid, speculative rounds, the screen, the memory plan, the roofline."""
