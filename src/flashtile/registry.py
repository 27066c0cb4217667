"""The kernel registry: every kernel family, in the order they are asked, and the one place a kernel is chosen.

For a :class:`~flashtile.family.Variant` the first family that serves it wins; each family that does not
says why (``flashtile explain`` prints those reasons). Forward families: decoding (one query token against a
cache), then the ladder's rungs, fastest first; backward families follow. A new family is one entry here.
"""

from __future__ import annotations

import functools

from . import backward, decode, ladder, specs
from .family import Family, Variant

FAMILIES: tuple[Family, ...] = (decode.FAMILY, *reversed(ladder.RUNGS), *backward.FAMILIES)


def reasons(variant: Variant) -> list[tuple[Family, str | None]]:
    """Every family of the variant's direction, in the order asked, with why it does not serve (None: it does)."""
    return [(f, f.unsupported(variant)) for f in FAMILIES if f.direction == variant.direction]


@functools.cache
def choose(variant: Variant, rung: str | int = "auto") -> tuple[Family, specs.KernelSpec]:
    """The family that serves `variant` (the first that does, or the named rung) and the spec it compiles.

    ValueError, with every family's reason, when none does.
    """
    if rung != "auto":
        family = ladder.get(rung)
        why_not = family.unsupported(variant)
        if why_not:
            raise ValueError(why_not)
        return family, family.spec(variant)
    answers = reasons(variant)
    for family, why_not in answers:
        if why_not is None:
            return family, family.spec(variant)
    raise ValueError("no kernel serves these inputs: " + "; ".join(why for _, why in answers))


# The variants `flashtile compile` builds ahead of time and CI compiles for every architecture: each head dim
# pair the kernels are built for, plus softcap and ALiBi at the most common head dim, and short causal forwards
# (their own tile class on rung 5).
_COMPILED_DIMS = tuple((d, d) for d in specs.FWD_HEAD_DIMS) + ((192, 128),)
_SCORE_MODS = (frozenset(), frozenset({"softcap"}), frozenset({"alibi"}))
_SCORE_MOD_HEAD_DIM = 128


def compiled_variants(arch: str):
    for direction in ("fwd", "bwd"):
        for dtype in specs.DTYPES:
            for d, dv in _COMPILED_DIMS:
                for features in _SCORE_MODS:
                    if features and d != _SCORE_MOD_HEAD_DIM:
                        continue
                    yield Variant(direction, dtype, d, dv, features, arch)
                    if direction == "bwd":
                        yield Variant(direction, dtype, d, dv, features, arch, deterministic=True)
                if direction == "fwd":
                    yield Variant(direction, dtype, d, dv, frozenset(), arch, "decode")
                    yield Variant(direction, dtype, d, dv, frozenset(), arch, short_causal=True)


def all_specs(arch: str) -> list[specs.KernelSpec]:
    """Every spec the library can ask for on `arch`: for each compiled variant, what every rung that serves it
    compiles (a caller may name any rung) and what the chosen backward family compiles. `flashtile compile`
    builds this list; CI compiles it for several archs."""
    found: dict[specs.KernelSpec, None] = {}
    for variant in compiled_variants(arch):
        for family, why_not in reasons(variant):
            if why_not is None:
                found.setdefault(family.spec(variant))
                for spec in family.more_specs(variant) if family.more_specs else ():
                    found.setdefault(spec)
                if family.rung is None:
                    break
    return list(found)

