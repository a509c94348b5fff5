"""A reproduce command a caller writes reaches the card without any secret flag value (whatever it
looks like) and without an absolute local path (issue 32, item 7)."""

from __future__ import annotations

import os

from safety_tiny import make_trainer

from hf_constrained.publishable import is_secret_flag
from hf_constrained.publishing.card import ModelCardInfo, render_model_card
from hf_constrained.publishing.report import ConstraintResult, SafetyReport
from hf_constrained.redact import redact_command
from hf_constrained.safety.finish import finish_run

# none of these looks like an "hf_..." token: only the flag's name says it is a secret
SECRETS = ["plainHubToken42", "wandbKEY0099", "s3cr3t-value", "hunter2", "envtoken77", "apikeyvalue"]


def _command(local: str) -> str:
    return (f"HF_TOKEN=envtoken77 CUDA_VISIBLE_DEVICES=0 python {local}/train.py --hub_token plainHubToken42 "
            f"--wandb_api_key=wandbKEY0099 --client_secret s3cr3t-value --db-password hunter2 "
            f"--openai_key apikeyvalue --data {local}/rows.csv --output_dir {local}/runs/x "
            f"--logging_dir={local}/runs/x/logs --learning_rate 1e-3 --group_key g --max_new_tokens 8")


def test_redact_command_drops_every_secret_flag_and_local_path():
    local = "/home/alice/private"
    shown = redact_command(_command(local))
    for secret in SECRETS:
        assert secret not in shown
    assert "/home/alice" not in shown and "alice" not in shown
    assert shown == ("CUDA_VISIBLE_DEVICES=0 python '<local>/train.py' --data '<local>/rows.csv' "
                     "--output_dir '<output_dir>' '--logging_dir=<output_dir>/logs' --learning_rate 1e-3 "
                     "--group_key g --max_new_tokens 8")
    assert redact_command(shown) == shown  # idempotent
    assert redact_command(None) is None
    assert redact_command("python x.py --hub_token 'unbalanced") == "python x.py"


def test_secret_flag_names():
    secret = ["--hub_token", "--wandb_api_key", "--my_key", "--client_secret", "--db_password", "HF_TOKEN",
              "AWS_SECRET_ACCESS_KEY", "--auth-token", "--credentials"]
    public = ["--max_new_tokens", "--keys", "--tokenizer_name", "--include_num_input_tokens_seen",
              "--average_tokens_across_devices", "--group_key", "--pad_token", "--learning_rate"]
    assert [is_secret_flag(f) for f in secret] == [True] * len(secret)
    assert [is_secret_flag(f) for f in public] == [False] * len(public)


def test_finish_run_writes_no_secret_and_no_local_path_into_the_card(tmp_path):
    out = tmp_path / "runs" / "x"  # the command's --output_dir
    trainer = make_trainer(str(out), tolerance=2.0, max_steps=2, eval_strategy="no", save_strategy="no",
                           load_best_model_at_end=False, metric_for_best_model=None)
    trainer.train()
    finish_run(trainer, plots=False, reproduce_command=_command(str(tmp_path)))
    written = "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file()
                      and p.suffix in (".md", ".json", ".yaml", ".txt"))
    for secret in SECRETS:
        assert secret not in written
    assert str(tmp_path) not in written
    card = (out / "README.md").read_text()
    assert "--output_dir '<output_dir>'" in card and "--learning_rate 1e-3" in card


def test_a_card_info_set_by_hand_is_redacted_too(tmp_path):
    report = SafetyReport([ConstraintResult("c", 0.1, 0.2)], model_name="m", safety_rule="point")
    info = ModelCardInfo(reproduce_command=f"python train.py --wandb_api_key wandbKEY0099 --data {os.sep}srv/x.csv")
    text = str(render_model_card(report, model_name="m", info=info))
    assert "wandbKEY0099" not in text and "/srv/" not in text and "<local>/x.csv" in text
