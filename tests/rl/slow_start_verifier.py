"""A verifier whose module takes 3 s to import in a worker process (not in the parent), to
show that replacing a hung worker does not hold up the batch being scored."""

import multiprocessing
import time

if multiprocessing.current_process().name != "MainProcess":
  time.sleep(3.0)


def hang_or_match(completion: str, answer: str) -> float:
  if answer == "hang":
    time.sleep(60.0)
  return float(completion == answer)
