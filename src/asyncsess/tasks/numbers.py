"""Numbers as graders compare them: ASCII decimal strings in one canonical spelling, with no conversion to
``int`` or ``float`` (a reply can hold a number of 100k digits, which ``int()`` refuses and ``float()`` makes
``inf``)."""

from __future__ import annotations

import re

__all__ = ["DECIMAL", "canonical"]

DECIMAL = re.compile(r"-?[0-9]*\.?[0-9]+")  # what canonical() takes: ASCII digits only (not "٤٢" or "４２")


def canonical(number: str) -> str:
    """A decimal string (``DECIMAL``) without leading zeros, trailing fraction zeros or the sign of zero:
    ``"-007.50"`` -> ``"-7.5"``, ``"-0"`` and ``".0"`` -> ``"0"``."""
    sign, digits = ("-", number[1:]) if number.startswith("-") else ("", number)
    whole, _, frac = digits.partition(".")
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    out = whole + ("." + frac if frac else "")
    return "0" if out == "0" else sign + out
