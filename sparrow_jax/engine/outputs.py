"""Host-side bookkeeping of one `generate` call or rollout session, on arrays.

`RequestTable` holds every request's sampling parameters, stop ids and limits as arrays, so the
per-row inputs of a prefill or decode chunk are one gather each. `OutputBuffers` preallocates
every request's outputs: token ids, log-probs and the policy version that sampled each token
`[N, M]`, top-k ids and log-probs `[N, M, k]`
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
  """Per-request arrays of one generate call or session (row i = request i)."""

  def __init__(self, seqs: Sequence, vocab_size: int):
    self.vocab_size = vocab_size
    self._alloc(len(seqs), max([len(s.stop_ids) for s in seqs] + [1]))
    self.max_top_k = 0
    self.put(seqs)

  def _alloc(self, n: int, width: int) -> None:
    self.seed_words = np.zeros((n, 2), np.uint32)  # [N, 2]
    self.temperature = np.zeros((n,), np.float32)  # [N]
    self.top_p = np.ones((n,), np.float32)  # [N]
    self.top_k = np.zeros((n,), np.int32)  # [N]
    self.max_new = np.zeros((n,), np.int64)  # [N]
    self.prompt_len = np.zeros((n,), np.int32)  # [N]
    self.stop_ids = np.full((n, width), -1, np.int32)  # [N, S], -1 pads

  def grow(self, rows: int, width: int = 1) -> None:
    """Room for `rows` rows and `width` stop ids per row (a session adds requests); rows
    already set keep their values."""
    n, w = len(self.temperature), self.stop_ids.shape[1]
    if rows <= n and width <= w:
      return
    old = (self.seed_words, self.temperature, self.top_p, self.top_k, self.max_new,
           self.prompt_len, self.stop_ids)
    self._alloc(max(rows, n), max(width, w))
    for new, prev in zip((self.seed_words, self.temperature, self.top_p, self.top_k,
                          self.max_new, self.prompt_len), old):
      new[:n] = prev
    self.stop_ids[:n, :w] = old[-1]

  def put(self, seqs: Sequence) -> None:
    """Rows `s.index` from the sequences' requests (the table grows to hold them)."""
    if not seqs:
      return
    idx = np.asarray([s.index for s in seqs], np.int64)
    self.grow(int(idx.max()) + 1, max(len(s.stop_ids) for s in seqs))
    sps = [s.req.sampling for s in seqs]
    self.seed_words[idx] = seed_key_data([sp.seed for sp in sps])
    self.temperature[idx] = [sp.temperature for sp in sps]
    self.top_p[idx] = [sp.top_p for sp in sps]
    self.top_k[idx] = [min(sp.top_k, self.vocab_size) for sp in sps]
    self.max_new[idx] = [sp.max_new_tokens for sp in sps]
    self.prompt_len[idx] = [s.prompt_len for s in seqs]
    self.stop_ids[idx] = -1
    for i, s in zip(idx, seqs):
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
    self._alloc(n, m)

  def _alloc(self, n: int, m: int) -> None:
    k = self.topk
    self.tokens = np.zeros((n, m), np.int32)  # [N, M]
    self.logprobs = np.zeros((n, m), np.float32)  # [N, M]
    self.versions = np.zeros((n, m), np.int32)  # [N, M] policy version of each token
    self.topk_ids = np.zeros((n, m, k), np.int32)  # [N, M, k]
    self.topk_lps = np.zeros((n, m, k), np.float32)  # [N, M, k]

  def grow(self, rows: int, max_new: int) -> bool:
    """Room for `rows` requests of up to `max_new` tokens (a session adds requests); the
    contents are kept. True when the buffers moved (callers re-point their row views)."""
    n, m = self.tokens.shape
    if rows <= n and max_new <= m:
      return False
    old = (self.tokens, self.logprobs, self.versions, self.topk_ids, self.topk_lps)
    # Doubling: a session that keeps adding requests reallocates O(log N) times.
    self._alloc(max(rows, 2 * n if rows > n else n), max(max_new, m))
    for new, prev in zip((self.tokens, self.logprobs, self.versions, self.topk_ids,
                          self.topk_lps), old):
      new[:n, :m] = prev
    return True

  def append_one(self, seq_ids, start, tok, lp, tk_ids, tk_lps, version: int = 0) -> None:
    """One token per row (a prefill): rows `seq_ids` `[R]` at generated index `start` `[R]`,
    sampled by policy `version`."""
    self.tokens[seq_ids, start] = tok
    self.logprobs[seq_ids, start] = lp
    self.versions[seq_ids, start] = version
    if self.topk:
      self.topk_ids[seq_ids, start] = tk_ids
      self.topk_lps[seq_ids, start] = tk_lps

  def append_chunk(self, seq_ids, start, count, toks, lps, tk_ids, tk_lps,
                   version: int = 0) -> None:
    """A decode chunk: row j (request `seq_ids[j]`) generated `count[j]` tokens from index
    `start[j]`; `toks`, `lps` `[C, R]`, `tk_ids`, `tk_lps` `[C, R, k]` (step-major, as the
    device writes them), all sampled by policy `version`."""
    c = toks.shape[0]
    step, row = np.nonzero(np.arange(c)[:, None] < count[None, :])  # [T] valid (step, row)
    dst_seq, dst_pos = seq_ids[row], start[row] + step
    self.tokens[dst_seq, dst_pos] = toks[step, row]
    self.logprobs[dst_seq, dst_pos] = lps[step, row]
    self.versions[dst_seq, dst_pos] = version
    if self.topk:
      self.topk_ids[dst_seq, dst_pos] = tk_ids[step, row]
      self.topk_lps[dst_seq, dst_pos] = tk_lps[step, row]

  def slices(self, i: int, n: int):
    """(token ids `[n]`, log-probs `[n]`, top-k ids `[n, k]` | None, top-k log-probs | None,
    versions `[n]`) of request i: views of the buffers, no copies."""
    k = self.topk
    return (self.tokens[i, :n], self.logprobs[i, :n],
            self.topk_ids[i, :n] if k else None, self.topk_lps[i, :n] if k else None,
            self.versions[i, :n])
