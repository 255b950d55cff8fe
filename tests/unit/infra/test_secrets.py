"""Secret redaction (rlhf_train/infra/secrets.py): secret names matched by pattern, not by a list; values of
secret environment variables redacted wherever they appear; no shipped config key over-redacted."""
from __future__ import annotations

import pytest

# names that no list of whole names holds, and the model / config names that must stay visible
SECRET_NAMES = ["openai_api_key", "OPENAI_API_KEY", "api_token", "judge_token", "apiKey", "accessToken",
                "HF_TOKEN", "db_password", "client_secret", "GOOGLE_APPLICATION_CREDENTIALS", "http_auth",
                "signing_key", "aws_secret_access_key", "SLACK_BOT_TOKEN", "X-Api-Key", "Authorization",
                "+rewards.judge.anthropic_api_key", "api_keys"]
VISIBLE_NAMES = ["pad_token", "eos_token", "bos_token", "unk_token", "mask_token", "decoder_start_token_id",
                 "max_new_tokens", "tokenizer", "token_budget", "bos_token_id", "special_tokens", "exclude_keys",
                 "prompt_key", "rng_key", "public_key", "api_key_file", "SSH_AUTH_SOCK", "PWD",
                 "TOKENIZERS_PARALLELISM", "author", "keyword", "max_prompt_tokens", "tokens_per_step"]
ENV_SECRET = "env-secret-9f8e7d6c5b4a"


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names_are_matched_by_pattern(name):
    from rlhf_train.infra.secrets import is_secret_key, redact, redact_overrides

    assert is_secret_key(name)
    assert redact({"judge": {name.lstrip("+").rsplit(".", 1)[-1]: "s3cr3t-value"}}) == {
        "judge": {name.lstrip("+").rsplit(".", 1)[-1]: "<redacted>"}}
    assert "s3cr3t-value" not in redact_overrides(f"{name}=s3cr3t-value")


@pytest.mark.parametrize("name", VISIBLE_NAMES)
def test_model_token_and_config_names_stay_visible(name):
    from rlhf_train.infra.secrets import is_secret_key, redact

    assert not is_secret_key(name)
    assert redact({name: "<pad>"}) == {name: "<pad>"}


def test_secret_env_values_are_redacted_wherever_they_appear(monkeypatch):
    from rlhf_train.infra.secrets import dirname_overrides, redact, redact_overrides, scrub

    monkeypatch.setenv("MY_JUDGE_SERVICE_TOKEN", ENV_SECRET)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")  # too short to be replaced inside other strings
    cfg = {"rewards": {"judge": {"headers": f"Bearer {ENV_SECRET}", "url": "http://x:1"}}, "trainer": {"seed": 1}}
    assert redact(cfg) == {"rewards": {"judge": {"headers": "Bearer <redacted>", "url": "http://x:1"}},
                           "trainer": {"seed": 1}}
    assert ENV_SECRET not in repr(redact_overrides([f"+logger.notes={ENV_SECRET}", "trainer.seed=1"]))
    assert dirname_overrides(f"+logger.notes={ENV_SECRET},trainer.seed=1") == "trainer.seed=1"
    assert ENV_SECRET not in repr(scrub({"hydra": {"job": {"name": f"run-{ENV_SECRET}"}}}, set()))


def test_a_config_secret_is_redacted_where_it_is_copied_and_dicts_under_secret_names_keep_their_keys():
    from rlhf_train.infra.secrets import redact

    cfg = {"judge": {"openai_api_key": "sk-abcdef123456", "url": "https://api/?k=sk-abcdef123456"},
           "credentials": {"user": "me", "password": "hunter2hunter2"}, "auth": None, "use_auth": True}
    assert redact(cfg) == {"judge": {"openai_api_key": "<redacted>", "url": "https://api/?k=<redacted>"},
                           "credentials": {"user": "me", "password": "<redacted>"}, "auth": None,
                           "use_auth": True}


@pytest.mark.parametrize("recipe", [None, "smoke", "sentiment_ppo", "tldr_ppo", "tldr_sft", "default"])
def test_no_shipped_config_key_is_redacted(recipe, monkeypatch):
    """A checkpoint's config.yaml is read back (resume, export): redacting a model's setting would break it."""
    from omegaconf import OmegaConf

    from rlhf_train.infra.secrets import redact
    from tests.helpers.config import compose

    for k in [k for k in __import__("os").environ if "TOKEN" in k or "KEY" in k or "SECRET" in k]:
        monkeypatch.delenv(k)
    cfg = compose([f"+recipe={recipe}"] if recipe else [])
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert redact(plain) == plain
