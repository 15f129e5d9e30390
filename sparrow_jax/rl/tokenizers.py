"""A byte-level tokenizer for the random-init `tiny` model (no files, no downloads).

Ids: 0 pad, 1 bos, 2 eos, then byte b -> b + 3 (vocabulary 259, fits the tiny model's 512).
It exposes the small part of the transformers tokenizer interface the trainer uses.
"""

from __future__ import annotations

from typing import Sequence


class ByteTokenizer:
  pad_token_id = 0
  bos_token_id = 1
  eos_token_id = 2
  vocab_size = 259
  chat_template = None
  _OFFSET = 3

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    ids = [b + self._OFFSET for b in text.encode("utf-8")]
    return [self.bos_token_id] + ids if add_bos else ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    out = bytes(int(i) - self._OFFSET for i in ids
                if self._OFFSET <= int(i) < self.vocab_size)
    return out.decode("utf-8", errors="replace")

  def __call__(self, text: str):
    return {"input_ids": self.encode(text)}
