"""specq: quantization and speculative-decoding release gate (see README.md, whose architecture
section says what each subpackage holds and which may import which)."""
