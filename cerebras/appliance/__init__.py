"""`cerebras.appliance`: the emulator's implementation (cerebras_appliance) under the name the Cerebras
model zoo imports. This is an emulation of the vendor's API, not the vendor's
package: see docs/cstorch.md ("Import names")."""
from cs_runtime.import_names import alias

alias(__name__, "cerebras_appliance")
