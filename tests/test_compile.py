"""train.compile on the CPU (inductor, through the system's C++ compiler): a LoRA step of compiled
blocks computes the plain step's loss and gradients to float rounding, with and without gradient
checkpointing, with LoRA dropout drawing what eager draws, and leaves the module names (so the
LoRA's keys) as they were; a training through the train stage (the tiny Flux.1 and its encoded demo
photos), in one process and under 2-process DDP, logs the plain run's losses and exports a LoRA that
diffusers loads to the plain run's weight change, both to a stated tolerance (below: what was
measured); where it cannot apply, one line naming train.compile before training starts."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from lorapipe.cache.errors import UserError
from lorapipe.stages import families, train
from lorapipe.stages.train.compile import compile_blocks
from lorapipe.stages.train.launch import check_compile
from family_checks import fused_change
from test_block_swap import blocks, flux_transformer, step, train_flux

# inductor reorders float sums; measured on these CPUs: a step's loss equal, its gradients within 1.1e-8
ROUNDING = dict(rtol=1e-5, atol=1e-6)
# four steps: losses within 1.2e-7 of about 1.5 (ROUNDING); LoRA tensors within 8.3e-6, 1.7e-5 under DDP
# (AdamW at lr 1e-2 moves a weight by about the rate whatever its gradient's size: rounding grows)
LORA_TOLERANCE = dict(rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize(("checkpointing", "dropout"), [(False, 0.0), (True, 0.0), (False, 0.5)],
                         ids=["plain", "gradient_checkpointing", "lora_dropout"])
def test_a_compiled_step_matches_the_plain_one_to_float_rounding(checkpointing, dropout):
    plain = flux_transformer(checkpointing, dropout)
    torch.manual_seed(3)  # LoRA dropout's draws: inductor's own random numbers would draw others
    plain_loss, plain_grads = step(plain)
    model = flux_transformer(checkpointing, dropout)
    names = [name for name, _ in model.named_parameters()]
    torch._dynamo.reset()  # blocks of another model of the same shape would reuse its graphs
    graphs = counters["stats"]["unique_graphs"]
    compile_blocks(blocks(model))
    for _ in range(2):  # the second step runs what the first compiled
        torch.manual_seed(3)
        loss, grads = step(model)
        torch.testing.assert_close(loss, plain_loss, **ROUNDING)
        torch.testing.assert_close(grads, plain_grads, **ROUNDING)
    assert counters["stats"]["unique_graphs"] > graphs  # the blocks ran compiled, not eager
    assert [name for name, _ in model.named_parameters()] == names  # the LoRA's keys are unchanged


@pytest.mark.parametrize(("family", "options", "refusal"), [
    ("sd15", {}, "Stable Diffusion 1.x/2.x's denoiser has no chain of blocks to compile; remove it"),
    ("flux1", {"blocks_to_swap": 1}, "not with train.blocks_to_swap, whose hooks move a block's weights"),
])
def test_compile_where_it_cannot_apply_is_refused_in_one_line(family, options, refusal):
    check_compile(families.get(family), train.TrainOptions(**options))  # without compile: nothing to refuse
    with pytest.raises(UserError) as refused:
        check_compile(families.get(family), train.TrainOptions(compile=True, **options))
    assert str(refused.value).startswith(f"train.compile: {refusal}") and "\n" not in str(refused.value)


def test_compile_without_a_cpp_compiler_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with pytest.raises(UserError, match=r"^train.compile: torch compiles CPU kernels with a C\+\+ compiler and"
                                        r" no-such-c\+\+-compiler is not on the PATH: install one"):
        check_compile(families.get("flux1"), train.TrainOptions(compile=True))


def test_a_unet_refuses_compile_before_training_starts(tmp_path, tiny_model, encoded):
    inputs = train.TrainInputs(encoded.artifact_dir, encoded.cache_root, tiny_model, "base", encoded.digest)
    with pytest.raises(UserError, match=r"^train.compile: Stable Diffusion 1.x/2.x's denoiser has no chain"):
        train.run(train.TrainParams(max_steps=1), inputs, tmp_path / "out", tmp_path / "work",
                  train.TrainOptions(compile=True, log_with="none"), log=lambda line: None)
    assert not (tmp_path / "work").exists()  # no training process was started


@pytest.mark.slow
def test_training_with_compiled_blocks_matches_training_without(tmp_path, flux_model, flux_encoded, monkeypatch):
    from diffusers import FluxPipeline

    monkeypatch.setenv("TORCH_LOGS", "dynamo")  # the training process logs what dynamo traces
    plain_losses, plain_lora, plain_log = train_flux(tmp_path, "plain", flux_model, flux_encoded)
    losses, lora, log = train_flux(tmp_path, "compiled", flux_model, flux_encoded, compile=True,
                                   gradient_checkpointing=True)
    assert "torchdynamo start tracing" in log and "torchdynamo start tracing" not in plain_log
    torch.testing.assert_close(losses, plain_losses, **ROUNDING)
    assert lora.keys() == plain_lora.keys()
    torch.testing.assert_close(lora, plain_lora, **LORA_TOLERANCE)
    changes = [fused_change(FluxPipeline.from_pretrained(flux_model), "transformer",
                            tmp_path / name / "pytorch_lora_weights.safetensors") for name in ("compiled", "plain")]
    assert any(delta.abs().max() > 0 for delta in changes[0].values())  # the file loaded: the weights moved
    torch.testing.assert_close(changes[0], changes[1], **LORA_TOLERANCE)


@pytest.mark.slow
def test_ddp_training_with_compiled_blocks_matches_ddp_training_without(tmp_path, flux_model, flux_encoded, monkeypatch):
    monkeypatch.setenv("TORCH_LOGS", "dynamo")  # the training processes log what dynamo traces
    plain_losses, plain_lora, _ = train_flux(tmp_path, "plain", flux_model, flux_encoded, processes=2)
    losses, lora, log = train_flux(tmp_path, "compiled", flux_model, flux_encoded, processes=2, compile=True)
    assert "rank 1/2" in log and "torchdynamo start tracing" in log
    torch.testing.assert_close(losses, plain_losses, **ROUNDING)
    torch.testing.assert_close(lora, plain_lora, **LORA_TOLERANCE)
