"""The byte-level tokenizer of the random-init `tiny` model (no files, no downloads).

Ids: 0 pad, 1 bos, 2 eos, then byte b -> b + 3 (vocabulary 259, fits the tiny model's 512).
It lives with the checkpoint readers (`sparrow_jax.models.checkpoints.byte_tokenizer`), which
write it beside an exported policy and read it back; this module keeps the old import path.
"""

from __future__ import annotations

from sparrow_jax.models.checkpoints.byte_tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer"]
