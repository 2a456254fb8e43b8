"""The chief process: `python -m chief run.py ARGS...` (started by csrun_wse).

Runs the user's script as the chief: it compiles the model, loads it on the
CS system and drives training (see chief/trainer.py).
"""
from cs_runtime.user_script import run_script_as

if __name__ == "__main__":
    run_script_as("chief")
