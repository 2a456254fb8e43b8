"""`cerebras.pytorch`: the emulator's implementation (cs_torch) under the name the Cerebras
model zoo imports. This is an emulation of the vendor's API, not the vendor's
package: see docs/cstorch.md ("Import names")."""
import torch  # noqa: F401 (the vendor's package is a torch package: its types are torch's from the start)

from cs_runtime.import_names import alias
from cs_torch import lr_scheduler, optim, weight_decay_scheduler

alias(__name__, "cs_torch")
# cs_torch may have been imported before torch: the signatures the real API documents now name torch's types.
optim.document_signatures()
lr_scheduler.annotate()
weight_decay_scheduler.annotate()
