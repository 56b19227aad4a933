"""Thin stage modules (read inputs, call the libraries, write artifacts) and the STAGES table."""
