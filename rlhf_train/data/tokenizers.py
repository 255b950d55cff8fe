"""Tokenizer factories for the ``tokenizer`` config group."""
from __future__ import annotations

from rlhf_train.infra.errors import ConfigError


def validate_tokenizer(tokenizer, override: str):
    """EOS is required (responses end there); pad falls back to EOS only when the tokenizer has none."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer has no EOS token; use a tokenizer with an eos_token (set {override})")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # GPT-2 style: pad == EOS, masks tell them apart
    return tokenizer


def pretrained_tokenizer(pretrained: str | None = None, trust_remote_code: bool = False):
    """A Hugging Face tokenizer from a local dir, or a hub name already in the local cache."""
    from transformers import AutoTokenizer

    from rlhf_train.models.loading import check_loadable

    if not pretrained:
        raise ConfigError("tokenizer.pretrained is not set: set it to a tokenizer dir or hub name (the PPO stage "
                          "takes the policy's own when it is null)")
    path = check_loadable(pretrained, "tokenizer.pretrained", "tokenizer")
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return validate_tokenizer(tok, "tokenizer.pretrained")
