"""`cerebras_appliance` (also `cerebras.appliance`): the parts of the Cerebras
appliance client that the model zoo imports, as the emulator provides them.

This is an emulation of the vendor's API, not the vendor's package (see
docs/cstorch.md, "Import names"): log settings (`log`), the environment the
job's workers see (`environment`), debug args and ini settings (`run_utils`,
`utils.debug_args`, `utils.ini`), errors (`errors`), byte units
(`utils.units`), checkpoint paths (`storage`: local files) and telemetry
(`cluster.client`). The emulated cluster takes its settings from run.py's
flags and the params file, so debug args and inis are kept but change nothing.
"""
import logging

logger = logging.getLogger("cerebras.appliance")
