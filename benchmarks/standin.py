"""A stand-in tokenizer for the benchmarks' random token ids (no hub access), shared by the scripts in
``benchmarks/`` (not a package: each puts this folder on ``sys.path``). It imports nothing heavy, so a script
that must not import torchrl (``gpu.py``) can use it too."""
from __future__ import annotations


class StandInTokenizer:
    """What the trainer needs of a tokenizer for random-token prompts: ``vocab`` ids, EOS = pad = BOS = the
    last id (50256 for GPT-2's 50,257 tokens); decoding writes the ids as numbers."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.eos_token_id = self.pad_token_id = self.bos_token_id = vocab - 1

    def __len__(self) -> int:
        return self.vocab

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def batch_decode(self, rows, **_) -> list[str]:
        return [self.decode(r) for r in rows]
