"""The LM head's precision (``trainer.fp32_lm_head``) and the blockwise log-prob path on every device and dtype.

1. Under autocast (bf16) the head's matmul and log-softmax are float32 by default: the log-probs, entropies
   and the decode loop's logits are bit for bit those of the same pass without autocast; with the head set
   to the compute precision the logits are bf16 and the log-softmax still float32 (close, not equal).
2. The fused head kernel takes a bf16 weight (cast up per block) and gives it a bf16 gradient equal to the
   float32 computation's, cast; the logits kernel takes bf16 logits (each block cast up).
3. Both run on every device present (CPU here; CUDA where there is one), against the plain path.

Budget: ~3 s on 2 CPU cores.
"""
from __future__ import annotations

import pytest
import torch

from rlhf_train.core.logprob_kernel import (
    entropy_from_logits,
    head_logprobs_and_entropy,
    logprobs_and_entropy,
    logprobs_of_labels,
)
from rlhf_train.models.scoring import FP32_HEAD_ATTR, response_logprobs, vocab_major_logits

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _head_and_hidden(device="cpu", B=3, T=5, H=16, V=50):
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False).to(device)
    hidden = torch.randn(B, T, H, device=device)
    labels = torch.randint(0, V, (B, T), device=device)
    return head, hidden, labels


@pytest.mark.parametrize("grad", [True, False])
def test_fp32_head_under_autocast_is_the_fp32_pass(grad):
    head, hidden, labels = _head_and_hidden()
    hidden.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        lp, ent = response_logprobs(hidden, head, labels, temperature=0.7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp_ac, ent_ac = response_logprobs(hidden, head, labels, temperature=0.7)
            logits_t = vocab_major_logits(head, hidden[0].detach())
    assert torch.equal(lp, lp_ac) and torch.equal(ent, ent_ac)
    assert logits_t.dtype == torch.float32 and torch.equal(logits_t, head.weight @ hidden[0].detach().T)
    if grad:
        g = torch.autograd.grad(lp.sum(), hidden)[0]
        assert torch.equal(g, torch.autograd.grad(lp_ac.sum(), hidden)[0])
    # top-k goes through the token-major logits: float32 too
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lp_k = response_logprobs(hidden, head, labels, temperature=0.7, top_k=5, with_entropy=False)[0]
    with torch.no_grad():
        assert torch.equal(lp_k, response_logprobs(hidden, head, labels, temperature=0.7, top_k=5,
                                                   with_entropy=False)[0])


def test_head_in_the_compute_precision_keeps_a_float32_log_softmax():
    head, hidden, labels = _head_and_hidden()
    setattr(head, FP32_HEAD_ATTR, False)
    hidden.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert vocab_major_logits(head, hidden[0].detach()).dtype == torch.bfloat16
        lp, ent = response_logprobs(hidden, head, labels)
    assert lp.dtype == ent.dtype == torch.float32
    # the log-softmax of the bf16 logits, computed in float32
    logits16 = (hidden.detach().bfloat16() @ head.weight.detach().bfloat16().T).float()
    torch.testing.assert_close(lp.detach(), logprobs_of_labels(logits16, labels), atol=1e-5, rtol=0)
    exact = logprobs_of_labels(hidden.detach() @ head.weight.detach().T, labels)
    assert 0 < (lp.detach() - exact).abs().max() < 0.1  # bf16 logits: close, not equal
    lp.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_head_kernel_with_a_bf16_weight(device):
    torch.manual_seed(0)
    V, N, H = 40, 6, 8
    hidden = torch.randn(N, H, device=device, requires_grad=True)
    weight = torch.randn(V, H, device=device).bfloat16().requires_grad_()
    bias = torch.randn(V, device=device).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,), device=device)
    lp, ent = head_logprobs_and_entropy(hidden, weight, bias, labels, 0.7)
    gh, gw, gb = torch.autograd.grad(lp.sum() + 0.5 * ent.sum(), (hidden, weight, bias))
    w32, b32 = weight.detach().float().requires_grad_(), bias.detach().float().requires_grad_()
    logits = (hidden @ w32.T + b32) / 0.7
    lp0, ent0 = logprobs_of_labels(logits, labels), entropy_from_logits(logits)
    gh0, gw0, gb0 = torch.autograd.grad(lp0.sum() + 0.5 * ent0.sum(), (hidden, w32, b32))
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent0, atol=1e-5, rtol=0)
    torch.testing.assert_close(gh, gh0, atol=1e-5, rtol=1e-5)
    assert gw.dtype == gb.dtype == torch.bfloat16
    torch.testing.assert_close(gw, gw0.bfloat16(), atol=1e-2, rtol=1e-2)  # computed in float32, then cast
    torch.testing.assert_close(gb, gb0.bfloat16(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logits_kernel_on_every_device_and_dtype(device, dtype):
    """``logprobs_and_entropy`` on ``[V, N]`` logits of any float dtype: each block cast up to float32."""
    torch.manual_seed(0)
    logits_t = (3 * torch.randn(50, 7, device=device)).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (7,), device=device)
    lp, ent = logprobs_and_entropy(logits_t, labels, 0.7)
    (g,) = torch.autograd.grad(lp.sum() + ent.sum(), logits_t)
    ref = logits_t.detach().float().T.requires_grad_()
    lp0, ent0 = logprobs_of_labels(ref / 0.7, labels), entropy_from_logits(ref / 0.7)
    (g0,) = torch.autograd.grad(lp0.sum() + ent0.sum(), ref)
    assert lp.dtype == torch.float32 and g.dtype == dtype
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent0, atol=1e-5, rtol=0)
    torch.testing.assert_close(g.float(), g0.T.to(dtype).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_response_logprobs_on_every_device(device):
    head, hidden, labels = _head_and_hidden(device)
    lp, ent = response_logprobs(hidden, head, labels)
    logits = hidden @ head.weight.T
    torch.testing.assert_close(lp, logprobs_of_labels(logits, labels), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, entropy_from_logits(logits), atol=1e-5, rtol=0)
    if device != "cpu":  # the accelerator's autocast: float32 head, the same numbers
        with torch.autocast(device, dtype=torch.bfloat16):
            lp_ac, _ = response_logprobs(hidden, head, labels)
        assert torch.equal(lp, lp_ac)
