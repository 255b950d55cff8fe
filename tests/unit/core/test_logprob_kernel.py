"""The fast paths of the performance work give the same numbers as the plain ones.

1. ``logprobs_and_entropy`` (blockwise, vocabulary-major, gradient written in place) equals
   ``logprobs_of_labels`` + ``entropy_from_logits``, values and gradients, with and without temperature,
   with several vocabulary blocks, and its gradient passes ``gradcheck`` in float64; so does
   ``head_logprobs_and_entropy`` (the head's matmuls inside the blocks), with and without a bias, an
   entropy gradient and gradients at all, its gradients reaching the hidden states, weight and bias.
2. ``models.scoring.response_logprobs`` (what the policy's forward pass and the reference pass use)
   equals the plain ``process_logits`` + ``logprobs_of_labels`` path, with and without gradients, for a
   token count that is not a multiple of 8 (padded inside) and a head with a bias.
3. ``generation.hf_generate.InverseCDFSampler`` samples from ``softmax(process_logits(scores))``
   (chi-square test on a small vocabulary), never draws a token that top-k removed, and records the
   log-probs of its draws.
4. The policy's own passes take the fused head kernel for a Llama with a tied head (SmolLM2's layout: the
   head's weight is the input embedding), an untied Llama and a GPT-2 (tied): the update's forward with
   gradients and the no-grad scoring pass (the reference's) call ``head_logprobs_and_entropy``; the
   log-probs, entropies and every parameter's gradient (the tied weight's: embedding + head) equal the plain
   path's (the LM's own ``[B, T, V]`` logits, ``log_softmax``); no op of the no-grad pass writes more than
   one vocabulary block of logits, and the pass with gradients keeps one ``[V, N]`` buffer (its blocks'
   exponentials), never the ``[N, V]`` logits, their softmax or their gradient.

Budget: < 10 s on 2 CPU cores. (Speed itself is measured in ``benchmarks/``, never in tests.)
"""
import pytest
import torch

from rlhf_train.core import logprob_kernel
from rlhf_train.core.logprob_kernel import (
    entropy_from_logits,
    head_logprobs_and_entropy,
    logprobs_and_entropy,
    logprobs_of_labels,
)
from rlhf_train.core.sampling import process_logits
from rlhf_train.generation.hf_generate import InverseCDFSampler
from rlhf_train.models.scoring import response_logprobs


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(logprob_kernel, "_BLOCK_ELEMENTS", 7 * 5)  # 5 tokens -> blocks of 7 vocabulary rows


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_matches_plain_path(temperature, small_blocks):
    torch.manual_seed(0)
    V, N = 30, 5
    hidden = torch.randn(N, 8, requires_grad=True)
    weight = (2 * torch.randn(V, 8)).requires_grad_()
    labels = torch.randint(0, V, (N,))
    g_lp, g_ent = torch.randn(N), torch.randn(N)

    lp, ent = logprobs_and_entropy(weight @ hidden.T, labels, temperature, overwrite_logits=True)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logits = hidden @ weight.T / temperature
    lp0, ent0 = logprobs_of_labels(logits, labels), entropy_from_logits(logits)
    ((lp0 * g_lp).sum() + (ent0 * g_ent).sum()).backward()
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent0, atol=1e-5, rtol=0)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads[1], weight.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_gradcheck(temperature, small_blocks):
    torch.manual_seed(0)
    logits_t = torch.randn(30, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 30, (5,))
    assert torch.autograd.gradcheck(lambda x: logprobs_and_entropy(x, labels, temperature), (logits_t,))
    # only the log-probs used (the trainer's case with ent_coef = 0): no entropy gradient pass
    assert torch.autograd.gradcheck(lambda x: logprobs_and_entropy(x, labels, temperature)[0], (logits_t,))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_head_logprobs_and_entropy_matches_plain_path(temperature, bias, entropy_grad, small_blocks):
    torch.manual_seed(0)
    V, N, H = 30, 5, 8
    hidden = torch.randn(N, H, requires_grad=True)
    weight = (2 * torch.randn(V, H)).requires_grad_()
    b = torch.randn(V, requires_grad=True) if bias else None
    labels = torch.tensor([0, 29, 7, 7, 14])  # the first and last block, a label twice
    params = [hidden, weight] + ([b] if bias else [])
    g_lp, g_ent = torch.randn(N), torch.randn(N)

    def loss(lp, ent):
        return (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)

    lp, ent = head_logprobs_and_entropy(hidden, weight, b, labels, temperature, with_entropy=True)
    grads = torch.autograd.grad(loss(lp, ent), params)
    logits = (hidden @ weight.T + (b if bias else 0.0)) / temperature
    lp0, ent0 = logprobs_of_labels(logits, labels), entropy_from_logits(logits)
    grads0 = torch.autograd.grad(loss(lp0, ent0), params)
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent0, atol=1e-5, rtol=0)
    for g, g0 in zip(grads, grads0):
        torch.testing.assert_close(g, g0, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # one block of logits at a time
        lp_ng, ent_ng = head_logprobs_and_entropy(hidden, weight, b, labels, temperature, with_entropy=False)
    torch.testing.assert_close(lp_ng, lp0.detach(), atol=1e-5, rtol=0)
    assert ent_ng.isnan().all()


def test_head_logprobs_and_entropy_gradcheck(small_blocks):
    torch.manual_seed(0)
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(30, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 30, (5,))
    # log-probs and entropy; log-probs only (the trainer's case: the logits' gradient is never formed)
    assert torch.autograd.gradcheck(lambda h, w, b: head_logprobs_and_entropy(h, w, b, labels, 0.7),
                                    (hidden, weight, bias))
    assert torch.autograd.gradcheck(lambda h, w, b: head_logprobs_and_entropy(h, w, b, labels, 0.7)[0],
                                    (hidden, weight, bias))
    assert torch.autograd.gradcheck(lambda h, w: head_logprobs_and_entropy(h, w, None, labels, 1.0, False)[0],
                                    (hidden, weight))


@pytest.mark.parametrize("grad", [True, False])
def test_response_logprobs_matches_plain_path(grad):
    torch.manual_seed(0)
    B, T, H, V = 3, 5, 8, 40  # 15 tokens: padded to 16 inside
    head = torch.nn.Linear(H, V, bias=True)
    hidden = torch.randn(B, T, H, requires_grad=grad)
    labels = torch.randint(0, V, (B, T))
    with torch.set_grad_enabled(grad):
        lp, ent = response_logprobs(hidden, head, labels, temperature=0.7)
    expected = logprobs_of_labels(process_logits(head(hidden), 0.7), labels)
    torch.testing.assert_close(lp, expected.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, entropy_from_logits(head(hidden) / 0.7).detach(), atol=1e-5, rtol=0)
    if grad:
        lp.sum().backward()
        g = hidden.grad.clone()
        hidden.grad = None
        expected.sum().backward()
        torch.testing.assert_close(g, hidden.grad, atol=1e-5, rtol=1e-5)
    # top-k: the filtered distribution (plain path)
    with torch.no_grad():
        lp_k, _ = response_logprobs(hidden, head, labels, temperature=0.7, top_k=5, with_entropy=False)
        torch.testing.assert_close(lp_k, logprobs_of_labels(process_logits(head(hidden), 0.7, 5), labels))


def test_inverse_cdf_sampler_distribution_and_log_probs():
    torch.manual_seed(0)
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]])
    probs = torch.softmax(scores / 0.7, -1)[0]
    n = 20000
    sampler = InverseCDFSampler(temperature=0.7)
    out = sampler(None, scores.repeat(n, 1))
    tokens = out.argmax(-1)  # generate's greedy step picks the marked token
    assert torch.isinf(out.gather(-1, tokens[:, None])).all()
    counts = torch.bincount(tokens, minlength=6).double()
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum()
    assert chi2 < 25.0  # 5 degrees of freedom: p < 1e-4 for a correct sampler
    torch.testing.assert_close(sampler.log_probs[0], torch.log(probs)[tokens].float(), atol=1e-6, rtol=0)

    top2 = InverseCDFSampler(temperature=1.0, top_k=2)(None, scores.repeat(2000, 1)).argmax(-1)
    assert set(top2.tolist()) <= {0, 1}


def _lm(arch: str, tied: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    kw = ({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64} if arch == "gpt2" else
          {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 64})
    cfg = AutoConfig.for_model(arch, vocab_size=97, tie_word_embeddings=tied, **kw)
    return AutoModelForCausalLM.from_config(cfg).eval()


class _LogitWrites(torch.utils._python_dispatch.TorchDispatchMode):
    """The outputs of ops over the vocabulary and the tokens (a dimension ``V``, none ``H``: logits-like, not
    a weight or its gradient) of at least ``at_least`` elements, and the largest of all such outputs."""

    def __init__(self, V: int, H: int, at_least: int):
        super().__init__()
        self.V, self.H, self.at_least, self.largest, self.big = V, H, at_least, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and self.V in t.shape and self.H not in t.shape:
                self.largest = max(self.largest, t.numel())
                if t.numel() >= self.at_least:
                    self.big.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("gpt2", True)])
def test_policy_passes_take_the_fused_kernel_for_tied_and_untied_heads(arch, tied, small_blocks, monkeypatch):
    from rlhf_train.models import scoring
    from rlhf_train.models.policy import PolicyWithValue

    lm = _lm(arch, tied)
    assert (lm.get_output_embeddings().weight is lm.get_input_embeddings().weight) == tied
    policy = PolicyWithValue(lm, None)
    B, P, T, V = 3, 6, 5, 97
    full = torch.randint(2, V, (B, P + T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, P + T, dtype=torch.bool)
    mask[0, :2] = False  # a left-padded prompt
    calls = []
    fused = scoring.head_logprobs_and_entropy
    monkeypatch.setattr(scoring, "head_logprobs_and_entropy", lambda *a, **k: calls.append(1) or fused(*a, **k))
    g_lp, g_ent = torch.randn(B, T), torch.randn(B, T)
    params = [p for p in lm.parameters()]

    writes = _LogitWrites(V, 32, at_least=B * T * V // 2)
    with writes:
        lp, ent, _ = policy(full, mask, P, labels=full[:, P:], temperature=0.7)
        grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), params)
    assert calls and [shape for _, shape in writes.big] == [(V, 16)]  # the one [V, N] buffer (N = 15, padded to 16)

    logits = lm(input_ids=full, attention_mask=mask.long(), position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    z = logits[:, P - 1:-1] / 0.7
    lp0, ent0 = logprobs_of_labels(z, full[:, P:]), entropy_from_logits(z)
    grads0 = torch.autograd.grad((lp0 * g_lp).sum() + (ent0 * g_ent).sum(), params)
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent0, atol=1e-5, rtol=1e-5)
    for (name, _), g, g0 in zip(lm.named_parameters(), grads, grads0):
        torch.testing.assert_close(g, g0, atol=1e-5, rtol=1e-4, msg=name)

    calls.clear()
    writes = _LogitWrites(V, 32, at_least=B * T * V // 2)
    with writes, torch.no_grad():  # the reference's scoring pass
        ref = scoring.sequence_logprobs(lm, full, mask, P, temperature=0.7)
    assert calls and not writes.big and writes.largest <= logprob_kernel._BLOCK_ELEMENTS
    torch.testing.assert_close(ref, lp0.detach(), atol=1e-5, rtol=1e-5)
