"""The reference model as a Ray service: ``ref_model.ray_service.enabled=true``.

The pattern of torchrl's ``RayKLRewardTransform`` / ``RayRetrieveKL``: the frozen reference π_ref lives
in one named Ray actor that every training process (all ranks of an ``accelerate launch``, or several
runs that name the same actor) sends its sequences to. The model is never shipped through Ray: the
actor is built from a small picklable *factory* that loads the weights where the actor runs.

  1. the reference weights come from ``ref_model.pretrained`` when set; otherwise the main process
     saves the reference the trainer built (an exact copy of the initial policy) to
     ``<run dir>/reference_model`` once, so the actor's copy is identical to the in-process one
  2. the main process starts (or joins, ``ref_model.ray_service.address``) a Ray cluster and
     gets-or-creates the named actor; the other processes join the same cluster and look the actor up by name
  3. ``ref_log_prob(full [B, P+T], full_mask [B, P+T], prompt_len) -> [B, T]`` ships CPU tensors to
     the actor, which runs :func:`rlhf_train.models.scoring.sequence_logprobs` (one forward pass, the sampling
     temperature without top-k / top-p, ``rollout.logprob_batch_size`` rows at a time) and ships back fp32

Ray is an optional extra: ``pip install -e ".[ray]"``.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.core.sampling import SamplingParams
from rlhf_train.infra.checkpoint import apply_umask
from rlhf_train.infra.errors import ConfigError

REFERENCE_DIR = "reference_model"  # in the run dir, when the reference is a copy of the policy
RAY_DEFAULTS = {  # ref_model.ray_service (conf/ref_model/copy_of_policy.yaml documents each key)
    "address": None, "namespace": "rlhf_train", "num_cpus": 1, "num_gpus": 0, "device": None,
    "detached": False,
}


@dataclass(frozen=True)
class LoadReference:
    """The model factory sent to the actor: loads π_ref from a saved dir (local path or cached hub name)."""

    path: str
    trust_remote_code: bool = False

    def __call__(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        return model.eval().requires_grad_(False)


class ReferenceLogProbActor:
    """Holds π_ref; ``log_probs`` is :meth:`rlhf_train.models.reference.Reference.log_probs` run where the actor lives."""

    def __init__(self, factory: Callable[[], torch.nn.Module], temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, batch_size: int | None = None, device: str | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = factory().to(self.device)
        self.temperature, self.top_k, self.top_p, self.batch_size = temperature, top_k, top_p, batch_size

    def ready(self) -> str:
        return str(self.device)

    @torch.no_grad()
    def log_probs(self, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """``[B, P+T]`` tokens and mask → ``[B, T]`` float32 log π_ref of the response tokens (on CPU)."""
        from rlhf_train.models.scoring import sequence_logprobs

        step = self.batch_size or full.shape[0]
        out = [sequence_logprobs(self.model, full[i:i + step].to(self.device), full_mask[i:i + step].to(self.device),
                                 prompt_len, self.temperature, self.top_k, self.top_p).float().cpu()
               for i in range(0, full.shape[0], step)]
        return torch.cat(out)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("ref_model.ray_service.enabled=true needs Ray: pip install -e \".[ray]\" "
                          "(or set ref_model.ray_service.enabled=false)") from None
    return ray


def ray_options(cfg: DictConfig) -> dict:
    """``ref_model.ray_service`` (less ``enabled`` / ``actor_name``) merged over :data:`RAY_DEFAULTS`;
    unknown keys are an error."""
    given = cfg.ref_model.get("ray_service") or {}
    given = OmegaConf.to_container(given, resolve=True) if OmegaConf.is_config(given) else dict(given)
    given = {k: v for k, v in given.items() if k not in ("enabled", "actor_name")}
    unknown = sorted(set(given) - set(RAY_DEFAULTS))
    if unknown:
        raise ConfigError(f"ref_model.ray_service.{unknown[0]} is not a key; valid: enabled, actor_name, "
                          f"{', '.join(RAY_DEFAULTS)}")
    return {**RAY_DEFAULTS, **given}


def reference_source(cfg: DictConfig, ref_model: torch.nn.Module | None, run_dir: str | Path) -> str:
    """Where the actor loads π_ref from. Call on the main process only (it may write the weights)."""
    if cfg.ref_model.get("pretrained"):
        from rlhf_train.models.loading import check_loadable

        return check_loadable(cfg.ref_model.pretrained, "ref_model.pretrained", "reference model")
    if ref_model is None:
        raise ConfigError("ref_model.ray_service.enabled=true: set ref_model.pretrained=<dir>, or let "
                          "the trainer pass the reference it built")
    final = Path(run_dir) / REFERENCE_DIR
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{REFERENCE_DIR}-", dir=final.parent))
    try:  # written aside, then moved into place: a crash never leaves a half-written reference
        ref_model.save_pretrained(tmp, safe_serialization=True)
        apply_umask(tmp)  # mkdtemp (0700) and safetensors (0600): use the umask's modes
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final.resolve())


def default_actor_name(source: str) -> str:
    """One actor per reference: the ranks of a run share it; another run gets its own."""
    return "rlhf_ref_" + hashlib.sha1(os.path.abspath(source).encode()).hexdigest()[:12]


def _reference_sampling(rollout_cfg: DictConfig) -> tuple[float, int, float]:
    """``(temperature, top_k, top_p)`` the reference scores under: the sampling temperature alone
    (:meth:`SamplingParams.for_scoring`, as in the in-process reference pass)."""
    s = SamplingParams(float(rollout_cfg.temperature), int(rollout_cfg.top_k), float(rollout_cfg.top_p)).for_scoring()
    return s.temperature, s.top_k, s.top_p


def get_or_create_actor(ray, name: str, factory: LoadReference, options: dict, rollout_cfg: DictConfig):
    """The named actor ``name`` (created with ``factory`` if nobody has created it yet)."""
    remote_cls = ray.remote(num_cpus=options["num_cpus"], num_gpus=options["num_gpus"])(ReferenceLogProbActor)
    actor = remote_cls.options(
        name=name, namespace=options["namespace"], get_if_exists=True,
        lifetime="detached" if options["detached"] else None,
    ).remote(factory, *_reference_sampling(rollout_cfg), rollout_cfg.logprob_batch_size, options["device"])
    ray.get(actor.ready.remote())  # surfaces load errors here, before training starts
    return actor


def _join_auth_settings(auth_env: dict) -> None:
    """Adopt the main process's Ray token-auth settings (Ray >= 2.5x caches them when it is imported)."""
    os.environ.update(auth_env)
    if auth_env.get("RAY_AUTH_MODE", "").lower() == "token":
        try:  # what ray.init does in the process that starts a local cluster
            from ray._private.authentication.authentication_token_setup import (
                _enable_token_auth,
            )
        except ImportError:  # older Ray: no token auth
            return
        _enable_token_auth()


def ray_ref_log_prob_fn(cfg: DictConfig, ref_model: torch.nn.Module | None = None,
                        run_dir: str | Path | None = None) -> Callable:
    """``(full, full_mask, prompt_len) -> [B, T]`` reference log-probs computed by the shared Ray actor.

    Collective when several processes run (``accelerate launch``): call it on every process.
    """
    ray = _import_ray()
    from accelerate.utils import broadcast_object_list

    from accelerate import PartialState

    opts = ray_options(cfg)
    state = PartialState()
    info, failure, actor = [None, None, None, {}], None, None  # [cluster address, actor name, error, env]
    if state.is_main_process:
        try:
            source = reference_source(cfg, ref_model, run_dir or os.getcwd())
            name = cfg.ref_model.ray_service.get("actor_name") or default_actor_name(source)
            if not ray.is_initialized():
                local = {} if opts["address"] else {"num_cpus": max(1, int(opts["num_cpus"]))}
                ray.init(address=opts["address"], namespace=opts["namespace"], include_dashboard=False,
                         **local)
            factory = LoadReference(source, bool(cfg.ref_model.get("trust_remote_code", False)))
            actor = get_or_create_actor(ray, name, factory, opts, cfg.rollout)  # keep the handle: it owns the actor
            # Ray's token authentication is switched on through the environment of the process that
            # started the cluster: the processes joining it need the same settings
            auth_env = {k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")
                        if k in os.environ}
            info = [ray.get_runtime_context().gcs_address, name, None, auth_env]
        except Exception as err:  # tell the other processes, so nobody waits forever
            info, failure = [None, None, f"{type(err).__name__}: {err}", {}], err
    if state.num_processes > 1:
        info = broadcast_object_list(info, from_process=0)
    address, name, error, auth_env = info
    if failure is not None:
        raise failure
    if error is not None:
        raise RuntimeError(f"the reference-model Ray service failed to start on the main process: {error}")
    if actor is None:  # the other processes join the main process's cluster and look the actor up
        if not ray.is_initialized():
            _join_auth_settings(auth_env)
            ray.init(address=address, namespace=opts["namespace"])
        actor = ray.get_actor(name, namespace=opts["namespace"])

    def ref_log_prob(full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        out = ray.get(actor.log_probs.remote(full.detach().cpu(), full_mask.detach().cpu(), int(prompt_len)))
        return out.to(full.device)

    ref_log_prob.actor_name = name
    return ref_log_prob
