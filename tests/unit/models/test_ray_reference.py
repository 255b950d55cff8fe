"""The reference model as a Ray service (``ref_model.ray_service.enabled=true``).

Runs a local Ray (1 CPU) in this process; skipped when Ray is not installed (``pip install -e ".[ray]"``;
CI installs it). Budget: ~30-60 s on 2 cores (Ray start-up + two 2-iteration smoke runs).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

CONF = str(Path(__file__).resolve().parents[3] / "conf")


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rlhf_train.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return hydra_compose("config", overrides=["+recipe=smoke", "logger=none", "trainer.progress_bar=false",
                                                  "trainer.num_threads=1", *overrides])


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (starting one costs seconds); shut down afterwards."""
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, namespace="rlhf_train_test")  # 2 scheduling slots
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_reference_gives_same_rewards(tmp_path, local_ray):
    """Same seed, same rewards, with π_ref in the Ray actor instead of in this process."""
    from rlhf_train.loop.trainer import train
    from rlhf_train.models.ray_reference import REFERENCE_DIR, default_actor_name

    local = train(compose(), tmp_path / "local")
    served = train(compose("ref_model.ray_service.enabled=true",
                           "ref_model.ray_service.namespace=rlhf_train_test"), tmp_path / "ray")

    # the actor was built from a factory that loaded the saved initial policy, and is reachable by name
    source = tmp_path / "ray" / REFERENCE_DIR
    assert (source / "model.safetensors").is_file()
    actor = ray.get_actor(default_actor_name(str(source.resolve())), namespace="rlhf_train_test")
    assert ray.get(actor.ready.remote()) == "cpu"
    assert served["rollout"].reference.fn.actor_name == default_actor_name(str(source.resolve()))

    assert len(local["history"]) == len(served["history"]) == 2
    for a, b in zip(local["history"], served["history"]):
        for key in ("objective/score", "objective/reward_total", "objective/reward_kl", "objective/kl"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-5), (key, a[key], b[key])
    # the first iteration's policy equals the reference, so its KL is zero through the service too
    assert abs(served["history"][0]["objective/kl"]) < 1e-5
    ray.kill(actor)


@pytest.mark.timeout(120)
def test_ray_actor_matches_in_process_log_probs(tmp_path, local_ray):
    """The actor's ``[B, T]`` log-probs are those of :func:`sequence_logprobs` on the same weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf_train.models.ray_reference import LoadReference, ReferenceLogProbActor
    from rlhf_train.models.scoring import sequence_logprobs

    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=50)).eval()
    lm.save_pretrained(tmp_path / "ref")
    full = torch.randint(2, 50, (3, 12))
    mask = torch.ones_like(full, dtype=torch.bool)
    mask[0, :3] = False  # a left-padded prompt
    expected = sequence_logprobs(lm, full, mask, 5, 0.7, 5, 0.9)
    # the actor class itself (no Ray), then through a Ray actor built from the factory
    direct = ReferenceLogProbActor(LoadReference(str(tmp_path / "ref")), 0.7, 5, 0.9, batch_size=2, device="cpu")
    torch.testing.assert_close(direct.log_probs(full, mask, 5), expected)
    actor = ray.remote(num_cpus=1)(ReferenceLogProbActor).remote(LoadReference(str(tmp_path / "ref")),
                                                                  0.7, 5, 0.9, None, "cpu")
    torch.testing.assert_close(ray.get(actor.log_probs.remote(full, mask, 5)), expected, rtol=1e-5, atol=1e-5)
