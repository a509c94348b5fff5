"""One place where a free-form command becomes publishable: :func:`redact_command`.

A reproduce command reaches a model card, a report or a result file as a string a caller
wrote (``finish_run(reproduce_command="accelerate launch train.py --hub_token ...")``,
``ModelCardInfo(reproduce_command=...)``). The recipes build theirs from ``sys.argv`` with
:func:`hf_constrained.publishable.publishable_command`; a caller's string gets the same
treatment here, whatever its shape:

- every flag whose name carries a secret (:func:`hf_constrained.publishable.is_secret_flag`:
  ``--hub_token``, ``--wandb_api_key``, ``--my_secret``, ``--db_password``, any ``*key*`` or
  ``*token*`` flag that is not a count or a tokenizer setting) is dropped with its value, in
  both the ``--flag value`` and ``--flag=value`` forms, whatever the value looks like (not
  only ``hf_...``-shaped tokens);
- an environment assignment before the program (``HF_TOKEN=abc python train.py``) whose
  name carries a secret is dropped;
- every absolute local path (the program's too) is made relative or replaced by a
  placeholder (:func:`hf_constrained.publishable.publishable_path`);
- any token-shaped string left is replaced by ``<redacted>``.

The function is idempotent: a command it returns comes back unchanged.
"""

from __future__ import annotations

import re
import shlex
from typing import Optional

from .publishable import is_secret_flag, publishable_argv, redact_secrets

_ENV_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)


def redact_command(command: Optional[str], output_dir: Optional[str] = None) -> Optional[str]:
    """``command`` without secrets and absolute local paths, quoted for a POSIX shell (see the
    module docstring). ``output_dir``: the run's output folder, shown as ``<output_dir>``
    (by default the command's own ``--output_dir``). ``None`` stays ``None``."""
    if command is None:
        return None
    try:
        words = shlex.split(command)
    except ValueError:  # unbalanced quotes: still split on whitespace, never publish it verbatim
        words = command.split()
    out: list[str] = []
    env_done = False
    for i, word in enumerate(words):
        match = None if env_done else _ENV_ASSIGNMENT.match(word)
        if match is None:
            env_done = True
            out.extend(publishable_argv(words[i:], output_dir))
            break
        name, value = match.groups()
        if not is_secret_flag(name):
            out.append(f"{name}={publishable_argv([value], output_dir)[0] if value else ''}")
    return redact_secrets(shlex.join(out))


__all__ = ["redact_command"]
