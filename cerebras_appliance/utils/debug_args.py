"""Where newer releases import debug args from."""
from cerebras_appliance.run_utils import DebugArgs, get_debug_args, write_debug_args

__all__ = ["DebugArgs", "get_debug_args", "write_debug_args"]
