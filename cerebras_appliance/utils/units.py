"""Byte units, as the model zoo converts checkpoint shard sizes ("10GB"): cs_runtime/units.py."""
from cs_runtime.units import bytes_to_human, convert_byte_unit  # noqa: F401
