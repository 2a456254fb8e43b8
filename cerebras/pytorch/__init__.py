"""`cerebras.pytorch`: the emulator's implementation (cs_torch) under the name the Cerebras
model zoo imports. This is an emulation of the vendor's API, not the vendor's
package: see docs/cstorch.md ("Import names")."""
import cs_torch
from cs_runtime.import_names import alias

alias(__name__, "cs_torch")
cs_torch._as_vendor_package()
