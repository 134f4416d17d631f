"""The chunked causal-LM loss (hftrain/model/fused_loss.py): transformers' value and gradient, used where it applies."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers.loss.loss_utils import ForCausalLMLoss

import hftrain
from hftrain.checkpoint.layout import RunLayout
from hftrain.model import fused_loss

from ..support.checks import losses
from ..support.data import make_documents, tiny_recipe, write_jsonl

VOCAB = 1000


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 50, VOCAB, generator=gen) * 3
    labels = torch.randint(0, VOCAB, (3, 50), generator=gen)
    labels[0, :7] = -100  # a masked prompt
    labels[2, 20:] = -100  # padding
    return logits, labels


def _loss_and_grad(fn, logits, labels, dtype, **kwargs):
    x = logits.clone().to(dtype).requires_grad_()
    loss = fn(x, labels, VOCAB, **kwargs)
    (loss * 0.5).backward()  # an upstream gradient other than 1, as gradient accumulation gives
    return loss.detach(), x.grad.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_items_in_batch", [None, 111])
def test_value_and_gradient_are_transformers(monkeypatch, dtype, num_items_in_batch):
    monkeypatch.setattr(fused_loss, "CHUNK_BYTES", 7 * 4 * VOCAB)  # 7-row chunks: 150 rows end in a partial one
    logits, labels = _batch()
    ref_loss, ref_grad = _loss_and_grad(ForCausalLMLoss, logits, labels, dtype, num_items_in_batch=num_items_in_batch)
    loss, grad = _loss_and_grad(fused_loss.causal_lm_loss, logits, labels, dtype, num_items_in_batch=num_items_in_batch)
    assert loss.dtype == ref_loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-8 if dtype == torch.float32 else 1e-5)
    assert (grad[0, :6] == 0).all() and (grad[2, 20:] == 0).all()  # positions predicting masked labels get nothing


def test_the_comparison_sees_a_mask_that_is_not_applied():
    """The check above fails for a loss that scores the masked positions (-100 read as a label)."""
    logits, labels = _batch()
    ref, _ = _loss_and_grad(ForCausalLMLoss, logits, labels, torch.float32)
    unmasked, _ = _loss_and_grad(fused_loss.causal_lm_loss, logits, labels.clamp(min=0), torch.float32)
    assert unmasked.item() != pytest.approx(ref.item(), rel=1e-6)


def test_given_shift_labels_are_used_as_they_are():
    logits, labels = _batch(1)
    shifted = torch.roll(labels, -2, dims=1)
    ref, ref_grad = _loss_and_grad(ForCausalLMLoss, logits, labels, torch.float32, shift_labels=shifted)
    loss, grad = _loss_and_grad(fused_loss.causal_lm_loss, logits, labels, torch.float32, shift_labels=shifted)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6) and torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-8)


def test_without_autograd_it_is_transformers_loss_exactly():
    logits, labels = _batch(2)
    with torch.no_grad():
        assert torch.equal(fused_loss.causal_lm_loss(logits, labels, VOCAB), ForCausalLMLoss(logits, labels, VOCAB))


def test_a_second_backward_is_refused_not_wrong():
    """The backward scales the saved gradient in place; a second pass through the graph must fail loudly."""
    logits, labels = _batch()
    x = logits.clone().requires_grad_()
    loss = fused_loss.causal_lm_loss(x, labels, VOCAB)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_auto_applies_to_eager_cpu_training_only_and_speed_loss_decides_otherwise():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert fused_loss.applies(cpu, compiled=False)
    assert not fused_loss.applies(cpu, compiled=True)  # measured: torch.compile fuses the loss itself there
    assert not fused_loss.applies(cuda, compiled=False)
    for device, compiled in [(cpu, False), (cpu, True), (cuda, True)]:
        assert fused_loss.applies(device, compiled, "chunked") and not fused_loss.applies(
            device, compiled, "transformers"
        )


@pytest.mark.parametrize("num_items_in_batch", [None, 111])
def test_compiled_it_is_transformers_loss_and_gradient_in_fp32(monkeypatch, num_items_in_batch):
    """Traced by torch.compile, the loss takes its sliced form (no fp32 copy of all the logits): transformers' value
    and gradient within 1e-6, masked labels included. aot_eager traces forward and backward as inductor would."""
    # 16-row slices: 150 rows end in a partial one
    monkeypatch.setattr(fused_loss, "CHUNK_BYTES_COMPILED", 16 * 4 * VOCAB)
    logits, labels = _batch(3)
    calls = {"sliced": 0}
    real = fused_loss._sliced_cross_entropy

    def counted(*args, **kwargs):
        calls["sliced"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_loss, "_sliced_cross_entropy", counted)
    torch._dynamo.reset()
    compiled = torch.compile(fused_loss.causal_lm_loss, backend="aot_eager", fullgraph=True)
    ref, ref_grad = _loss_and_grad(
        ForCausalLMLoss, logits, labels, torch.float32, num_items_in_batch=num_items_in_batch
    )
    loss, grad = _loss_and_grad(compiled, logits, labels, torch.float32, num_items_in_batch=num_items_in_batch)
    assert calls["sliced"] >= 1  # the compiled form ran (traced), not the eager autograd.Function
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    assert torch.allclose(grad, ref_grad, rtol=1e-6, atol=1e-9)
    unmasked, _ = _loss_and_grad(
        compiled, logits, labels.clamp(min=0), torch.float32, num_items_in_batch=num_items_in_batch
    )
    assert abs(unmasked.item() - ref.item()) > 1e-5 * abs(ref.item())  # the comparison sees a mask that is not applied


def _train(tmp_path, name, steps=12, loss="auto"):
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(300))
    raw = tiny_recipe(data, tmp_path / name, max_steps=steps, save_steps=100, bf16=False, torch_compile=False)
    raw["model"].update(hidden_dropout=0, attention_dropout=0)
    raw["monitor"]["sample_max_new_tokens"] = 0
    raw["speed"] = {"loss": loss}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return hftrain.train(hftrain.load_recipe(path))


def test_cpu_training_uses_it_and_learns_as_with_transformers_loss(tmp_path, monkeypatch):
    run = _train(tmp_path, "chunked")
    assert run.model.loss_function is fused_loss.causal_lm_loss
    reasons = json.loads(RunLayout(run.output_dir).results.read_text())["speed"]["reasons"]
    assert "loss: cross-entropy in chunks, no fp32 copy of all the logits (eager training on a CPU)" in reasons
    plain = _train(tmp_path, "plain", loss="transformers")
    assert plain.model.loss_function is not fused_loss.causal_lm_loss
    chunked, reference = losses(run), losses(plain)
    assert sorted(chunked) == sorted(reference) == list(range(1, 13))
    for step in reference:  # same model, data and seed: the same training to fp32 rounding
        assert chunked[step] == pytest.approx(reference[step], rel=1e-5), step
