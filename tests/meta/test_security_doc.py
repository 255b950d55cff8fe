"""docs/security.md says what a user must know and it is true: configs are code (a ``_target_`` runs any
callable, shown here running a shell command), and where the user's data goes. Budget: < 1 s."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "security.md"


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", PAGE.read_text(), flags=re.DOTALL | re.MULTILINE)
    assert m, f"docs/security.md has no '## {title}' section"
    return m.group(1)


def test_security_doc_says_configs_are_code_and_what_to_do():
    text = _section("Configs are code")
    for needed in ("`_target_`", "os.system", "trust", "hydra.callbacks", "--cfg job"):
        assert needed in text, f"'## Configs are code' does not mention {needed}"
    assert "security.md" in (REPO / "README.md").read_text()


def test_a_target_runs_any_callable_as_the_doc_says(tmp_path, monkeypatch):
    """The claims behind the section: a ``_target_`` in an importable module runs that module's code (through
    Hydra's ``instantiate``, as most components are built), and a ``rewards`` entry's ``_target_`` goes through
    Hydra's list of refused targets too (``os.system`` is refused before anything runs)."""
    import pytest
    from hydra.utils import instantiate

    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.rewards.sources import build_reward_sources

    (tmp_path / "someone_elses.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
                                               f"def factory(**kw):\n    return kw\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert instantiate({"_target_": "someone_elses.factory", "lr": 1}) == {"lr": 1}
    assert (tmp_path / "imported").exists()
    marker = tmp_path / "owned"
    with pytest.raises(ConfigError, match="refused by Hydra's target policy"):
        build_reward_sources(None, {"x": {"_target_": "os.system", "command": f"touch {marker}"}}, None, 0)
    assert not marker.exists()


def test_security_doc_says_where_data_goes():
    text = _section("Where your data goes")
    for needed in ("data=prompts", "HF_HOME", "TMPDIR", "cache_dir", "samples.jsonl", "save_to_disk"):
        assert needed in text, f"'## Where your data goes' does not mention {needed}"
