"""The one command-line convention every CLI of the project follows: `--name_with_underscores`
and `--name-with-dashes` are the same flag. For parsers made with allow_abbrev=False (the scripts'):
with abbreviations on, `--mod` would match both spellings of --model_dir and be refused."""
from __future__ import annotations

import argparse


def add_flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> argparse.Action:
    """parser.add_argument("--name", "--na-me", dest="name", ...): both spellings of one flag."""
    spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
    return parser.add_argument(*spellings, dest=name, **kwargs)
