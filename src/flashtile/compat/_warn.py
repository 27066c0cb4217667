"""One warning per fallback reason: a front door that hands a call to another implementation says so once."""

from __future__ import annotations

import warnings


class FallbackWarning(UserWarning):
    """A call was served by another attention implementation (torch SDPA, transformers' sdpa or eager)."""


_warned: set[tuple[str, str]] = set()


def warn_once(front_door: str, reason: str, target: str, stacklevel: int = 3) -> None:
    """Warn that `front_door` handed a call to `target` because of `reason`, the first time only.

    The default `stacklevel` points at the caller of the function that calls this one.
    """
    if (front_door, reason) in _warned:
        return
    _warned.add((front_door, reason))
    warnings.warn(f"flashtile.{front_door}: {reason}; falling back to {target} (warned once per reason)",
                  FallbackWarning, stacklevel=stacklevel)


def reset_warnings() -> None:
    """Forget which reasons were already warned about (for tests)."""
    _warned.clear()
