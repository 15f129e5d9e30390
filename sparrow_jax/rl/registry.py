"""Named registries for the pieces of the RL algorithm: policy losses, advantage estimators
and rollout corrections (tunix's function registry and verl's `adv_estimator` /
`policy_loss.loss_mode` names are the models).

A new estimator is one decorated function, not edits across files:

    @ADVANTAGES.register("grpo")
    def grpo_advantages(rewards, group_ids, *, normalize_std=True): ...

    ADVANTAGES.get("grpo")        # the function; an unknown name is a ValueError naming
                                  # the registry and every known name
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
  """name -> callable, with a one-line description each (for `--list-keys` and docs)."""

  def __init__(self, kind: str):
    self.kind = kind
    self._fns: dict[str, F] = {}
    self._docs: dict[str, str] = {}

  def register(self, name: str, doc: str = "") -> Callable[[F], F]:
    if not isinstance(name, str) or not name:
      raise ValueError(f"{self.kind} registry: name={name!r}; expected a non-empty string")

    def deco(fn: F) -> F:
      if name in self._fns and self._fns[name] is not fn:
        raise ValueError(f"{self.kind} {name!r} is registered already ({self._fns[name]!r})")
      self._fns[name] = fn
      first = (fn.__doc__ or "").strip().splitlines()
      self._docs[name] = doc or (first[0] if first else "")
      return fn

    return deco

  def get(self, name: str) -> F:
    try:
      return self._fns[name]
    except KeyError:
      raise ValueError(f"unknown {self.kind} {name!r}; expected one of "
                       f"{sorted(self._fns)}") from None

  def doc(self, name: str) -> str:
    self.get(name)
    return self._docs[name]

  def names(self) -> tuple[str, ...]:
    return tuple(sorted(self._fns))

  def __contains__(self, name: object) -> bool:
    return name in self._fns

  def __iter__(self) -> Iterator[str]:
    return iter(self.names())


POLICY_LOSSES: Registry = Registry("policy loss")
ADVANTAGES: Registry = Registry("advantage estimator")
CORRECTIONS: Registry = Registry("rollout correction")
