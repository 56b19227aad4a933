"""Measured decode time: the plain grid, speculative rounds, batched cells and the closed loop, the memory plan, the roofline."""
