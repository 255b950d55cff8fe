"""The one line the W&B logger prints when it does not log online gives the real reason (issue 18, item 3).

No test touches the network: the credential and reachability probes are monkeypatched, and ``wandb`` is a
stand-in module that records what ``wandb.init`` got.
"""
from __future__ import annotations

import sys
import types

import pytest
from omegaconf import OmegaConf

from rlhf_train.infra import logger as lg
from rlhf_train.infra.errors import ConfigError


@pytest.fixture
def probes(monkeypatch):
    """Credentials / network probes that never touch the network; tests set ``state`` to choose."""
    state = {"logged_in": True, "reachable": True}
    monkeypatch.setattr(lg, "_wandb_logged_in", lambda: state["logged_in"])
    monkeypatch.setattr(lg, "_wandb_reachable", lambda timeout=2.0: state["reachable"])
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    return state


def test_wandb_mode_offline_env_says_so(tmp_path, probes, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    mode, why = lg.wandb_mode("auto", tmp_path)
    assert mode == "offline"
    assert why.startswith("WANDB_MODE=offline is set") and f"{tmp_path}/wandb" in why and "wandb sync" in why
    assert "credentials" not in why and "network" not in why
    probes["logged_in"] = False  # still the env var that decides, and says so
    assert lg.wandb_mode("auto", tmp_path)[1] == why


def test_wandb_mode_disabled_env_says_so(tmp_path, probes, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    mode, why = lg.wandb_mode("auto", tmp_path)
    assert mode == "disabled" and why.startswith("WANDB_MODE=disabled is set") and "logs nothing" in why


def test_wandb_mode_no_credentials_says_how_to_log_in(tmp_path, probes):
    probes["logged_in"] = False
    mode, why = lg.wandb_mode("auto", tmp_path)
    assert mode == "offline" and "not logged in" in why and "wandb login" in why and "WANDB_API_KEY" in why
    assert "network" not in why and "wandb sync" in why


def test_wandb_mode_no_network_says_so(tmp_path, probes):
    probes["reachable"] = False
    mode, why = lg.wandb_mode("auto", tmp_path)
    assert mode == "offline" and "cannot be reached" in why and "api.wandb.ai" in why and "login" not in why


def test_wandb_mode_online_and_explicit_modes(tmp_path, probes, monkeypatch):
    assert lg.wandb_mode("auto", tmp_path) == ("online", None)
    monkeypatch.setenv("WANDB_MODE", "online")
    probes["reachable"] = False
    assert lg.wandb_mode("auto", tmp_path) == ("online", None)  # the user asked for it
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert lg.wandb_mode("online", tmp_path) == ("online", None)  # logger.mode wins over the env var
    mode, why = lg.wandb_mode("offline", tmp_path)
    assert mode == "offline" and why.startswith("logger.mode=offline")
    mode, why = lg.wandb_mode("disabled", tmp_path)
    assert mode == "disabled" and why.startswith("logger.mode=disabled")


def test_wandb_mode_bad_values_name_the_key(tmp_path, probes, monkeypatch):
    with pytest.raises(ConfigError, match=r"^logger\.mode='offlne'"):
        lg.wandb_mode("offlne", tmp_path)
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(ConfigError, match=r"^WANDB_MODE='ofline'"):
        lg.wandb_mode("auto", tmp_path)


def test_wandb_logger_prints_the_reason_and_passes_the_mode(tmp_path, probes, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace(id="x"),
                                 Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = OmegaConf.create({"kind": "wandb", "project": "p", "entity": None, "group": None, "name": None,
                            "mode": "auto", "tags": []})
    lg.WandbLogger(tmp_path, cfg, {"task_name": "smoke"})
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [(f"[rlhf_train] W&B: WANDB_MODE=offline is set: logging offline to {tmp_path}/wandb; "
                    f"`wandb sync {tmp_path}/wandb/offline-run-*` uploads it later")]
    assert calls[-1]["mode"] == "offline" and calls[-1]["dir"] == str(tmp_path)


def test_final_metrics_and_samples_are_valid_json_with_null_for_non_finite(tmp_path):
    """NaN / inf (a skipped update's loss, a reward that overflowed) are written as null: bare NaN / Infinity
    are not JSON (strict readers: jq, JavaScript, json.loads with parse_constant)."""
    import json

    import torch

    def strict(text):
        def refuse(name):
            raise ValueError(f"not JSON: {name}")
        return json.loads(text, parse_constant=refuse)

    metrics = {"loss": float("nan"), "kl": float("inf"), "score": torch.tensor(-float("inf")), "lr": 1e-4}
    lg.write_final_metrics(tmp_path, metrics, [{"iteration": 1, **metrics}])
    written = strict((tmp_path / "final_metrics.json").read_text())
    assert written["metrics"] == {"loss": None, "kl": None, "score": None, "lr": 1e-4}
    assert written["history"] == [{"iteration": 1, "loss": None, "kl": None, "score": None, "lr": 1e-4}]
    lg.write_final_metrics(tmp_path, {"loss": 0.5}, [{"iteration": 2, "loss": 0.5}])  # a resume extends it
    assert [h["iteration"] for h in strict((tmp_path / "final_metrics.json").read_text())["history"]] == [1, 2]
    csv_logger = lg.CSVLogger(tmp_path)
    csv_logger.log_samples([{"prompt": "a", "response": "b", "score": float("nan")}], 3)
    assert strict((tmp_path / "samples.jsonl").read_text())["score"] is None
