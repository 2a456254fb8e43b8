"""Byte units, as the model zoo converts checkpoint shard sizes ("10GB") and the worker cache reports sizes."""
from __future__ import annotations

# Decimal (KB, MB, ...) and binary (KiB, MiB, ...) units; B is a byte.
_UNITS = {"B": 1}
for _i, _p in enumerate("KMGTPE", start=1):
    _UNITS[f"{_p}B"] = 1000 ** _i
    _UNITS[f"{_p}iB"] = 1024 ** _i


def _factor(unit: str) -> int:
    if unit not in _UNITS:
        raise ValueError(f"unknown byte unit {unit!r}: expected one of {', '.join(_UNITS)}")
    return _UNITS[unit]


def convert_byte_unit(value: float, target_unit: str, src_unit: str = "B", precision: int | None = None) -> float:
    """`value` src_unit in target_unit (convert_byte_unit(10, "B", src_unit="KB") == 10000)."""
    out = value * _factor(src_unit) / _factor(target_unit)
    return round(out, precision) if precision is not None else out


def bytes_to_human(value: float, fmt: str = "{value:.2f}{unit}") -> str:
    """1536 -> '1.50KiB': the largest binary unit that keeps the number at least 1."""
    unit = "B"
    for name in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(value) >= _UNITS[name]:
            unit = name
    return fmt.format(value=value / _UNITS[unit], unit=unit)
