"""specq: quantization and speculative-decoding release gate (see README.md)."""
import logging
import os

# torchao registers Enum pytree constants on import, which torch 2.14 logs as a deprecation
# warning on every process start; it says nothing about specq's run.
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
