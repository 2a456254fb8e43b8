"""Where newer releases import ini settings from."""
from cerebras_appliance.run_utils import set_default_ini, set_ini

__all__ = ["set_default_ini", "set_ini"]
