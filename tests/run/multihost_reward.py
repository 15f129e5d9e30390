"""A deterministic test verifier for `test_multihost.py`: reward 1 when the byte sum of the
response is even. A random-init policy earns both values, so GRPO has a signal."""


def byte_parity(completion: str, answer: str) -> float:
  return float(sum(completion.encode()) % 2 == 0)
