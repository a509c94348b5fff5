"""Parse a recipe's flags (``parse_recipe_args``) and print what each process sees; launched by
tests/apps/test_launch_checks.py with the shipped multi-GPU config."""

from __future__ import annotations

import os
import sys

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.recipe_args import parse_recipe_args

(args,) = parse_recipe_args([ConstrainedTrainingArguments])
# one write per record, so two ranks sharing a pipe are less likely to split a line
sys.stdout.write(f"PARSED rank={os.environ.get('RANK')} world_size={args.world_size}\n")
sys.stdout.flush()
