"""Quantization schemes: one registry (schemes.SCHEMES) of quantizer and loader per scheme; checks; `checkpoint` variants."""
