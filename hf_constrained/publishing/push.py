"""Publishing to the Hub: the access check before training, and ``hf-constrained push`` after it.

* :func:`hub_access_problem`: why a push would fail (``HF_HUB_OFFLINE=1``, no token, the Hub
  unreachable or refusing the token), in one line, or ``None``. The recipes call it right after
  parsing their flags when ``--push_to_hub`` or ``--hub_model_id`` is given
  (:func:`check_hub_before_training`), so a run that could not publish stops before it trains,
  not after, under a traceback.
* :func:`push_run`: ``hf-constrained push RUN_DIR --repo_id owner/name`` uploads a finished run,
  as ``huggingface-cli upload`` would, only after the checks of ``hf-constrained report --check``
  (:func:`~hf_constrained.publishing.verify.check_run_dir`: the report is intact, names the weight
  files in the folder, and certifies them) and of the gate that judges a folder's weights
  (the same check; and the folder must hold the weights it vouches for). A refusal is one line.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

PUSH_IGNORE = ["checkpoint-*", "checkpoint-*/**", "*.tmp*", "runs/**", "optimizer.pt", "scheduler.pt", "rng_state*.pth",
               "*.lock", "certify_cache/**"]
"""What ``hf-constrained push`` leaves out of the upload: checkpoints (judged on their own), training state, logs,
lock files (the empty ``certification_ledger.json.lock`` beside the ledger), the per-row values of
``hf-constrained certify`` (``certify_cache/``)."""

MODEL_FOLDER_FILES = ["config.json", "generation_config.json", "adapter_config.json", "tokenizer*", "vocab*",
                      "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template*", "*.model",
                      "preprocessor_config.json", "processor_config.json"]
"""Besides the weight files, what ``push`` uploads from the model folder a report names (``weights_folder``): the
configs and the tokenizer, never that folder's own report, card or training state."""

OFFLINE_BEFORE_TRAINING = ("unset it, or drop --push_to_hub / --hub_model_id and push the finished run later "
                           "(hf-constrained push RUN_DIR --repo_id owner/name)")
OFFLINE_PUSH = "unset it (or set HF_HUB_OFFLINE=0) and run the push again"
OFFLINE_TRAINER = "unset it (or set HF_HUB_OFFLINE=0)"
"""The offline advice for a ``ConstrainedTrainer`` built in the user's own code (no recipe flags to drop): the
trainer's error goes on to name the other way, ``push_to_hub=False`` and ``hf-constrained push`` afterwards."""


def hub_api() -> Any:
    """The Hub client (a function, so tests can replace it)."""
    from huggingface_hub import HfApi

    return HfApi()


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_access_problem(token: Optional[str] = None, api: Optional[Any] = None, *,
                       offline_hint: str = OFFLINE_BEFORE_TRAINING) -> Optional[str]:
    """Why a push to the Hub would fail, in one line, or ``None``: ``whoami`` with ``token`` (default:
    the logged-in token or ``HF_TOKEN``) through ``api`` (default: :func:`hub_api`). ``offline_hint``: what to
    do about ``HF_HUB_OFFLINE=1``, in the words of the command that asks (a recipe's flags, or ``push``)."""
    api = hub_api() if api is None else api
    try:
        api.whoami(token=token)
    except Exception as exc:  # noqa: BLE001 - any failure of the Hub client is the user's to fix, said in one line
        if _offline():
            return f"HF_HUB_OFFLINE=1 is set, so nothing can be pushed: {offline_hint}"
        from huggingface_hub import get_token

        if token is None and get_token() is None:
            return "no Hugging Face token: log in (hf auth login) or set HF_TOKEN, then run again"
        why = " ".join(str(exc).split())[:200]
        return f"the Hugging Face Hub cannot be reached or refuses the token ({type(exc).__name__}: {why})"
    return None


def check_hub_for_deferred_push(token: Optional[str] = None) -> None:
    """A ``RuntimeError`` in one sentence when the Hub cannot be reached or refuses ``token``: with
    ``push_to_hub=True`` and constraints the repository is created by the first push that passes the safety
    gate (so an unsafe run never creates one), and the trainer checks the access when it is built instead,
    where the Trainer itself would fail."""
    import transformers.trainer as hf_trainer  # its hf_api: the one the Trainer's pushes use

    problem = hub_access_problem(token, hf_trainer.hf_api(), offline_hint=OFFLINE_TRAINER)
    if problem is not None:
        raise RuntimeError(
            f"push_to_hub=True, but {problem}; the run would fail at its first push. Fix that (the network, "
            "`hf auth login`, HF_TOKEN or --hub_token), or train with push_to_hub=False and push the finished run "
            "afterwards (hf-constrained push RUN_DIR --repo_id owner/name)")


def check_hub_before_training(training_args: Any, error: Callable[[str], Any]) -> None:
    """With ``--push_to_hub`` or ``--hub_model_id``: ``error(message)`` (a parser's usage error) when the
    Hub cannot take the push (:func:`hub_access_problem`), before any model or data loads."""
    if not (getattr(training_args, "push_to_hub", False) or getattr(training_args, "hub_model_id", None)):
        return
    import transformers.trainer as hf_trainer  # its hf_api: the client the Trainer's own pushes use

    problem = hub_access_problem(getattr(training_args, "hub_token", None), hf_trainer.hf_api())
    if problem is not None:
        flag = "--push_to_hub" if getattr(training_args, "push_to_hub", False) else "--hub_model_id"
        error(f"{flag}: {problem}")


@dataclass
class PushResult:
    """What :func:`push_run` did: the exit status (0 pushed, 1 not certified, 2 cannot be trusted or
    pushed) and one line saying so."""

    exit_code: int
    message: str


def push_run(run_dir: str, repo_id: str, *, private: Optional[bool] = None, commit_message: Optional[str] = None,
             api: Optional[Any] = None) -> PushResult:
    """Upload the finished run in ``run_dir`` to ``repo_id`` after the checks of ``report --check`` and of
    the gate (see the module docstring); nothing is created or uploaded when a check fails."""
    from ..certification.fingerprint import weight_files, weights_files_fingerprint
    from .verify import EXIT_CERTIFIED, EXIT_STALE_OR_UNREADABLE, check_run_dir, weights_folder

    if "/" not in repo_id.strip("/"):
        return PushResult(2, f"--repo_id {repo_id!r}: give the full id, owner/name (e.g. your-user/{repo_id})")
    if not os.path.isdir(run_dir):
        return PushResult(2, f"{run_dir}: no such folder")
    check = check_run_dir(run_dir)  # the checks of `hf-constrained report RUN_DIR --check`
    if check.exit_code != EXIT_CERTIFIED:
        verdict = check.report.summary() if check.report is not None and check.exit_code != 2 else check.message
        return PushResult(check.exit_code, f"not pushed: {verdict}")
    elsewhere = check.report.weights_folder is not None  # `hf-constrained certify` of a model folder elsewhere
    if not elsewhere and weights_files_fingerprint(run_dir) is None:  # the gate judges the files it uploads
        from ..checkpointing import checkpoint_folders

        ready = [c for c in checkpoint_folders(run_dir) if check_run_dir(c).exit_code == EXIT_CERTIFIED
                 and weights_files_fingerprint(c) is not None]
        hint = f"push {ready[0]}, whose report certifies its own weights" if ready else \
            "save the model into the folder and evaluate it again"
        return PushResult(EXIT_STALE_OR_UNREADABLE, f"not pushed: {run_dir} holds no weight files for its report "
                          f"to vouch for; {hint}")
    if not os.path.isfile(os.path.join(run_dir, "README.md")):
        return PushResult(EXIT_STALE_OR_UNREADABLE, f"not pushed: {run_dir} has no model card (README.md); "
                          "finish_run writes one")
    api = hub_api() if api is None else api
    problem = hub_access_problem(api=api, offline_hint=OFFLINE_PUSH)  # this is the push: no flags to drop
    if problem is not None:
        return PushResult(EXIT_STALE_OR_UNREADABLE, f"not pushed: {problem}")
    api.create_repo(repo_id, exist_ok=True, private=private)
    message = commit_message or f"hf-constrained push: {check.report.summary()}"
    if elsewhere:  # the weights the report fingerprints (checked above), then the report and card over them
        folder = weights_folder(check.report, run_dir)
        api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message=f"{message} (weights)",
                          allow_patterns=weight_files(folder) + MODEL_FOLDER_FILES, ignore_patterns=PUSH_IGNORE)
    api.upload_folder(folder_path=run_dir, repo_id=repo_id, ignore_patterns=PUSH_IGNORE, commit_message=message)
    return PushResult(0, f"pushed {run_dir} to https://huggingface.co/{repo_id} ({check.report.summary()})")


__all__ = ["MODEL_FOLDER_FILES", "OFFLINE_BEFORE_TRAINING", "OFFLINE_PUSH", "OFFLINE_TRAINER", "PUSH_IGNORE",
           "PushResult", "check_hub_before_training", "check_hub_for_deferred_push", "hub_access_problem", "hub_api",
           "push_run"]
