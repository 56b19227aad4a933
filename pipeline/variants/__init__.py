"""Quantization schemes: one registry (schemes.SCHEMES) of quantizer, loader and byte figures per scheme; checks; `checkpoint` variants."""
