"""Block swap on the CPU: a swapped block holds its frozen weights only while it runs (empty tensors
otherwise), and a LoRA step computes the same loss and gradients, bit for bit, with and without the
swap, with and without gradient checkpointing."""
from __future__ import annotations

import pytest
import torch

from lorapipe.stages.train.block_swap import BlockSwap


def flux_transformer(checkpointing: bool):
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(2, 2, 4))
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian",
                                 target_modules=["to_q", "to_k", "to_v", "proj_mlp", "proj_out"]))
    if checkpointing:
        model.enable_gradient_checkpointing()
    return model.train()


def blocks(model) -> list[torch.nn.Module]:
    return [*model.transformer_blocks, *model.single_transformer_blocks]


def step(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = model(hidden_states=torch.randn(2, 16, 16, generator=g), encoder_hidden_states=torch.randn(2, 4, 16, generator=g),
                pooled_projections=torch.randn(2, 16, generator=g), timestep=torch.tensor([0.3, 0.7]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(4, 3), return_dict=False)[0]
    loss = out.float().pow(2).mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
@pytest.mark.parametrize("count", [1, 3])
def test_a_swapped_step_is_bit_for_bit_the_plain_one(checkpointing, count):
    plain = step(flux_transformer(checkpointing))
    model = flux_transformer(checkpointing)
    swap = BlockSwap(blocks(model), count, torch.device("cpu"))
    swapped_blocks = blocks(model)[-count:]
    for _ in range(2):  # a second step: the weights came back intact
        loss, grads = step(model)
        assert torch.equal(loss, plain[0]) and all(torch.equal(a, b) for a, b in zip(grads, plain[1]))
        frozen = [p for b in swapped_blocks for p in b.parameters() if not p.requires_grad]
        assert frozen and all(p.numel() == 0 for p in frozen)  # off between steps
    swap.remove()
    assert all(p.numel() for p in model.parameters())
    assert torch.equal(step(model)[0], plain[0])


def test_a_swapped_block_used_without_its_hooks_fails_instead_of_reading_stale_memory():
    model = flux_transformer(False)
    BlockSwap(blocks(model), 1, torch.device("cpu"))
    last = blocks(model)[-1]
    with pytest.raises(RuntimeError):
        torch.nn.functional.linear(torch.randn(1, 48), last.proj_out.base_layer.weight)


def test_swapping_more_blocks_than_the_model_has_is_one_line():
    with pytest.raises(ValueError, match=r"train.blocks_to_swap: 5 of 4 blocks; give 1 to 4"):
        BlockSwap(blocks(flux_transformer(False)), 5, torch.device("cpu"))
