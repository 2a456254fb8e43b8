"""The project's commands: csrun_wse, csrun_cpu, cs_system, csctl, cs_input_analyzer, cs_convert_checkpoint."""
# Whichever of them starts first removes the key folders of this user's launchers that died
# without cleaning up (kill -9 of the launcher and of its folder's watcher together): secret
# keys do not wait for the next job.
from cs_runtime.wire.auth import remove_dead_owners_folders

remove_dead_owners_folders()
