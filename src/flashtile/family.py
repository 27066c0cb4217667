"""What a kernel family is: the variant it is asked about, what it serves, and what it answers.

A :class:`Variant` is everything about a call that picks a kernel, derived once from the checked problem:
direction, dtype, head dims as the kernels see them, features, target architecture and a shape class. A
:class:`Family` is one kernel design (a ladder rung, a backward kernel, later a decode kernel): it says whether
it serves a variant and if not why, gives the :class:`~flashtile.specs.KernelSpec` that serves it, and builds
the launch plan of a concrete problem (plans.py). registry.py holds the families in the order they are asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import specs
from .forward import FwdProblem

FEATURES = ("window", "softcap", "alibi", "varlen")
# A call with at most this many query rows per sequence is a decode step (one new token per sequence): the
# shape class a decode family serves.
DECODE_MAX_QUERIES = 1


@dataclass(frozen=True, slots=True)
class Variant:
    direction: str                  # "fwd" | "bwd"
    dtype: torch.dtype
    head_dim: int                   # q/k head dim as the kernels see it (a multiple of 8)
    head_dim_v: int
    features: frozenset[str]        # a subset of FEATURES
    arch: str                       # NVRTC target, e.g. "sm_90a"
    shape: str = "prefill"          # "prefill" | "decode"
    deterministic: bool = False     # a backward that must be bitwise repeatable (its dQ adds take turns)
    short_causal: bool = False      # a causal forward of at most specs.HOPPER_SHORT_CAUSAL_KEYS keys (a tile class)

    @classmethod
    def of(cls, problem: FwdProblem, direction: str, arch: str, deterministic: bool = False) -> Variant:
        window = problem.window
        used = (("window", window[0] >= 0 or window[1] > 0), ("softcap", problem.softcap > 0),
                ("alibi", problem.alibi_slopes is not None), ("varlen", problem.varlen))
        short_causal = (direction == "fwd" and window == (-1, 0)
                        and problem.seqlen_k <= specs.HOPPER_SHORT_CAUSAL_KEYS)
        return cls(direction, problem.q.dtype, problem.head_dim, problem.head_dim_v,
                   frozenset(name for name, on in used if on), arch,
                   "decode" if problem.seqlen_q <= DECODE_MAX_QUERIES else "prefill", deterministic, short_causal)

    @property
    def dtype_name(self) -> str:
        return specs.DTYPES[self.dtype]

    @property
    def score_mods(self) -> bool:
        """Softcap or ALiBi: per-score work that the kernels compile in."""
        return "softcap" in self.features or "alibi" in self.features


@dataclass(frozen=True)
class Serves:
    """The plain-data part of what a family serves; `extra` answers what data cannot say."""

    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int
    features: frozenset[str]
    min_capability: tuple[int, int] = (7, 5)
    shapes: frozenset[str] = frozenset({"prefill", "decode"})
    extra: Callable[[Variant], str | None] | None = None

    def why_not(self, variant: Variant, who: str) -> str | None:
        if variant.dtype not in self.dtypes:
            return f"{who} supports dtypes {[str(d) for d in self.dtypes]}, not {variant.dtype}"
        if max(variant.head_dim, variant.head_dim_v) > self.max_head_dim:
            return f"{who} supports head_dim up to {self.max_head_dim}"
        for feature in FEATURES:
            if feature in variant.features and feature not in self.features:
                return f"{who} does not support {feature}"
        if specs.capability_of(variant.arch) < self.min_capability:
            return f"{who} needs compute capability {self.min_capability} or newer, not {variant.arch}"
        if variant.shape not in self.shapes:
            return f"{who} does not serve {variant.shape} shapes"
        return self.extra(variant) if self.extra is not None else None


@dataclass(frozen=True)
class Family:
    """One kernel design. `plan(problem, module, **options)` builds the launch plan of a concrete problem."""

    name: str
    direction: str                  # "fwd" | "bwd"
    summary: str
    serves: Serves
    spec: Callable[[Variant], specs.KernelSpec]
    plan: Callable[..., object]
    rung: int | None = None         # its place on the ladder (forward families that teach a step)
    tile: Callable[[Variant], object] | None = None  # the tile-table row it compiles (with its `why`), if any
    more_specs: Callable[[Variant], tuple] | None = None  # builds its plans may load besides `spec` (compiled too)

    def unsupported(self, variant: Variant) -> str | None:
        """Why this family cannot serve `variant`, or None if it can."""
        if variant.direction != self.direction:
            return f"{self.label} is a {self.direction} kernel"
        return self.serves.why_not(variant, self.label)

    @property
    def label(self) -> str:
        return f"rung {self.name!r}" if self.rung is not None else f"kernel {self.name!r}"

    # The ladder's view of a forward family (ladder.py, the CLI, the benchmarks).
    @property
    def number(self) -> int | None:
        return self.rung

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return self.serves.dtypes

    @property
    def max_head_dim(self) -> int:
        return self.serves.max_head_dim

    @property
    def min_capability(self) -> tuple[int, int]:
        return self.serves.min_capability
