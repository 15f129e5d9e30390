"""Host-side bookkeeping of one `generate` call, on arrays.

`RequestTable` holds every request's sampling parameters, stop ids and limits as arrays, so the
per-row inputs of a prefill or decode chunk are one gather each. `OutputBuffers` preallocates
every request's outputs: token ids and log-probs `[N, M]`, top-k ids and log-probs `[N, M, k]`
(M = the largest max_new_tokens; numpy's zeros are untouched pages until written, so a buffer
costs what its requests generate). A decode chunk's outputs are written into them in one
vectorised pass (`append_chunk`: one fancy-indexed assignment per output array, whatever the
number of tokens), and a `Completion` is built from slices of them. The engine this replaced
appended every generated token to Python lists one at a time, with one small numpy array per
token for the top-k rows: ~8M arrays per flagship step of 256 x 32K tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from sparrow_jax.engine.sampling import seed_key_data


class RequestTable:
  """Per-request arrays of one generate call (row i = request i)."""

  def __init__(self, seqs: Sequence, vocab_size: int):
    n = len(seqs)
    sps = [s.req.sampling for s in seqs]
    self.seed_words = seed_key_data([sp.seed for sp in sps])  # [N, 2] uint32
    self.temperature = np.asarray([sp.temperature for sp in sps], np.float32)  # [N]
    self.top_p = np.asarray([sp.top_p for sp in sps], np.float32)  # [N]
    self.top_k = np.asarray([min(sp.top_k, vocab_size) for sp in sps], np.int32)  # [N]
    self.max_new = np.asarray([sp.max_new_tokens for sp in sps], np.int64)  # [N]
    self.prompt_len = np.asarray([s.prompt_len for s in seqs], np.int32)  # [N]
    width = max([len(s.stop_ids) for s in seqs] + [1])
    self.stop_ids = np.full((n, width), -1, np.int32)  # [N, S], -1 pads
    for i, s in enumerate(seqs):
      ids = sorted(s.stop_ids)
      self.stop_ids[i, :len(ids)] = ids
    sampled = self.temperature > 0
    # Static top-k bound of the compiled sampler: the largest top_k of a sampled row.
    self.max_top_k = int(self.top_k[sampled].max()) if sampled.any() else 0

  def rows(self, seq_ids: np.ndarray):
    """Inputs of rows `seq_ids` `[R]` (-1: an empty row), in the order the jitted steps take
    them: stop ids `[R, S]`, seed words `[R, 2]`, temperature, top_p, top_k `[R]`."""
    valid = seq_ids >= 0
    idx = np.where(valid, seq_ids, 0)
    pick = lambda a, fill: np.where(valid.reshape((-1,) + (1,) * (a.ndim - 1)), a[idx], fill)
    return (pick(self.stop_ids, -1).astype(np.int32), pick(self.seed_words, 0).astype(np.uint32),
            pick(self.temperature, 0.0).astype(np.float32),
            pick(self.top_p, 1.0).astype(np.float32), pick(self.top_k, 0).astype(np.int32))


class OutputBuffers:
  """Preallocated outputs of every request (see the module docstring)."""

  def __init__(self, max_new: np.ndarray, topk: int):
    n, m = len(max_new), int(max(max_new, default=1))
    self.topk = topk
    self.tokens = np.zeros((n, m), np.int32)  # [N, M]
    self.logprobs = np.zeros((n, m), np.float32)  # [N, M]
    self.topk_ids = np.zeros((n, m, topk), np.int32)  # [N, M, k]
    self.topk_lps = np.zeros((n, m, topk), np.float32)  # [N, M, k]

  def append_one(self, seq_ids, start, tok, lp, tk_ids, tk_lps) -> None:
    """One token per row (a prefill): rows `seq_ids` `[R]` at generated index `start` `[R]`."""
    self.tokens[seq_ids, start] = tok
    self.logprobs[seq_ids, start] = lp
    if self.topk:
      self.topk_ids[seq_ids, start] = tk_ids
      self.topk_lps[seq_ids, start] = tk_lps

  def append_chunk(self, seq_ids, start, count, toks, lps, tk_ids, tk_lps) -> None:
    """A decode chunk: row j (request `seq_ids[j]`) generated `count[j]` tokens from index
    `start[j]`; `toks`, `lps` `[C, R]`, `tk_ids`, `tk_lps` `[C, R, k]` (step-major, as the
    device writes them)."""
    c = toks.shape[0]
    step, row = np.nonzero(np.arange(c)[:, None] < count[None, :])  # [T] valid (step, row)
    dst_seq, dst_pos = seq_ids[row], start[row] + step
    self.tokens[dst_seq, dst_pos] = toks[step, row]
    self.logprobs[dst_seq, dst_pos] = lps[step, row]
    if self.topk:
      self.topk_ids[dst_seq, dst_pos] = tk_ids[step, row]
      self.topk_lps[dst_seq, dst_pos] = tk_lps[step, row]

  def slices(self, i: int, n: int):
    """(token ids `[n]`, log-probs `[n]`, top-k ids `[n, k]` | None, top-k log-probs | None)
    of request i: views of the buffers, no copies."""
    k = self.topk
    return (self.tokens[i, :n], self.logprobs[i, :n],
            self.topk_ids[i, :n] if k else None, self.topk_lps[i, :n] if k else None)
