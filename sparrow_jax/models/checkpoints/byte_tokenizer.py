"""The byte-level tokenizer of the random-init `tiny` model, and its on-disk form.

Ids: 0 pad, 1 bos, 2 eos, then byte b -> b + 3 (vocabulary 259, fits the tiny model's 512).
`ByteTokenizer` exposes the small part of the transformers tokenizer interface the trainer
uses (no files, no downloads).

An exported tiny policy needs its tokenizer beside the weights. `ByteTokenizer.save_pretrained`
writes three files:

  sparrow_tokenizer.json   {"type": "byte", ...}: `load_tokenizer` sees it and returns a
                           `ByteTokenizer`, so our own tools encode exactly as in training.
  tokenizer.json           the same mapping for the `tokenizers` library: a byte-level
                           pre-tokenizer feeding a BPE model with no merges (every byte is one
                           token, id = byte + 3), a template that prepends bos, and a byte-level
                           decoder. transformers' `AutoTokenizer` loads it.
  tokenizer_config.json    special tokens, `split_special_tokens` (the text "<s>" is five
                           bytes here, as in `ByteTokenizer`, not the bos token) and the model
                           length. No chat template: the tiny model never saw one.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

MARKER_FILE = "sparrow_tokenizer.json"


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character table (what ByteLevel pre-tokenizes to)."""
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
  chars = {b: chr(b) for b in keep}
  n = 0
  for b in range(256):
    if b not in chars:
      chars[b] = chr(256 + n)
      n += 1
  return chars


class ByteTokenizer:
  pad_token_id = 0
  bos_token_id = 1
  eos_token_id = 2
  vocab_size = 259
  chat_template = None
  _OFFSET = 3
  _SPECIAL = ("<pad>", "<s>", "</s>")

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    ids = [b + self._OFFSET for b in text.encode("utf-8")]
    return [self.bos_token_id] + ids if add_bos else ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, *,
             errors: str = "replace") -> str:
    """UTF-8 text of the byte tokens. Bytes that form no character (a multi-byte sequence cut
    short, or a stray continuation byte) become U+FFFD with `errors="replace"`; logs that must
    show what was generated pass `errors="backslashreplace"` (`\\xe2`)."""
    out = bytes(int(i) - self._OFFSET for i in ids
                if self._OFFSET <= int(i) < self.vocab_size)
    return out.decode("utf-8", errors=errors)

  def __call__(self, text: str):
    return {"input_ids": self.encode(text)}

  # --- on disk ------------------------------------------------------------------------------
  def _marker(self) -> dict:
    return {"type": "byte", "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "offset": self._OFFSET, "vocab_size": self.vocab_size}

  def save_pretrained(self, path, *, model_max_length: int | None = None) -> list[str]:
    """Write the three files of the module docstring into directory `path`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    b2u = _bytes_to_unicode()
    vocab = {name: i for i, name in enumerate(self._SPECIAL)}
    vocab.update({b2u[b]: b + self._OFFSET for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting, so a space is just another byte as in `encode`.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in self._SPECIAL])
    bos = self._SPECIAL[self.bos_token_id]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, self.bos_token_id)])
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "pad_token": self._SPECIAL[self.pad_token_id], "bos_token": bos,
              "eos_token": self._SPECIAL[self.eos_token_id], "split_special_tokens": True,
              "add_bos_token": True, "clean_up_tokenization_spaces": False}
    if model_max_length is not None:
      config["model_max_length"] = int(model_max_length)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
      json.dump(config, f, indent=2)
    with open(os.path.join(path, MARKER_FILE), "w") as f:
      json.dump(self._marker(), f, indent=2)
    return ["tokenizer.json", "tokenizer_config.json", MARKER_FILE]

  @classmethod
  def from_pretrained(cls, path) -> "ByteTokenizer":
    """Read back a directory written by `save_pretrained` (checks the id layout)."""
    file = os.path.join(os.fspath(path), MARKER_FILE)
    try:
      with open(file) as f:
        marker = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f"cannot read {file}: {e}") from None
    tok = cls()
    if marker != tok._marker():
      raise ValueError(f"{file} describes {marker}; this version's byte tokenizer is "
                       f"{tok._marker()}")
    return tok


def is_byte_tokenizer_dir(path) -> bool:
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, MARKER_FILE))
