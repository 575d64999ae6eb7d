"""The adapter EMA: the average it keeps, its interval, its checkpoint file (a resumed run continues
the same average, bit for bit), and the export of the averaged weights on the tiny SD1.x."""
from __future__ import annotations

import pytest
import torch
from family_checks import merged, weight
from safetensors.torch import load_file

import lorapipe.stages.families as families
from lorapipe.stages.train.adapter import AdapterParams, peft_config
from lorapipe.stages.train.ema import AdapterEMA, EMAParams


def _adapter_unet(tiny_model):
    family = families.for_model(tiny_model)
    unet = family.load_denoiser(tiny_model, torch.float32)
    unet.requires_grad_(False)
    torch.manual_seed(0)
    unet.add_adapter(peft_config(AdapterParams(), family.lora_target_modules(unet, "attention")))
    return family, unet


def _step(model, step: int) -> None:
    """What an optimiser step does to the adapter: moves it (deterministically per step)."""
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 0.01)


@pytest.mark.parametrize("every", [1, 3])
def test_average_is_the_exponential_average_of_the_update_steps(every, tiny_model):
    _, unet = _adapter_unet(tiny_model)
    params = EMAParams(ema_decay=0.9, ema_every=every)
    ema = AdapterEMA(unet, params)
    name, weight = next((n, p) for n, p in unet.named_parameters() if p.requires_grad)
    expected = weight.detach().clone()
    for step in range(1, 8):
        _step(unet, step)
        updated = ema.update(step)
        assert updated == (step % every == 0)
        if updated:
            expected = 0.9 * expected + 0.1 * weight.detach()
    assert ema.updates == 7 // every
    assert torch.allclose(ema.average[name], expected, atol=1e-7)
    assert ema.average[name].device.type == "cpu" and ema.average[name].data_ptr() != weight.data_ptr()
    assert not any(p.requires_grad for n, p in unet.named_parameters() if "lora_" not in n)
    assert len(ema.average) == sum(1 for p in unet.parameters() if p.requires_grad)  # the adapter only


def test_a_resumed_run_continues_the_same_average(tiny_model, tmp_path):
    params = EMAParams(ema_decay=0.95, ema_every=2)
    _, straight = _adapter_unet(tiny_model)
    ema = AdapterEMA(straight, params)
    for step in range(1, 11):
        _step(straight, step)
        ema.update(step)

    _, first = _adapter_unet(tiny_model)
    before = AdapterEMA(first, params)
    for step in range(1, 6):
        _step(first, step)
        before.update(step)
    before.save(tmp_path / "ema.safetensors")
    resumed = AdapterEMA(first, params)  # a new process: the model as its checkpoint restores it
    resumed.load(tmp_path / "ema.safetensors")
    for step in range(6, 11):
        _step(first, step)
        resumed.update(step)
    assert resumed.updates == ema.updates == 5
    assert all(torch.equal(resumed.average[n], ema.average[n]) for n in ema.average)


def test_a_checkpoint_of_other_settings_is_refused_by_name(tiny_model, tmp_path):
    _, unet = _adapter_unet(tiny_model)
    AdapterEMA(unet, EMAParams(ema_decay=0.9)).save(tmp_path / "ema.safetensors")
    with pytest.raises(ValueError, match=r"ema.safetensors: cannot continue this EMA \(its ema_decay differ\)"):
        AdapterEMA(unet, EMAParams(ema_decay=0.99)).load(tmp_path / "ema.safetensors")


def test_export_inside_swapped_in_writes_the_average_and_restores_the_weights(tiny_model, tmp_path):
    family, unet = _adapter_unet(tiny_model)
    ema = AdapterEMA(unet, EMAParams(ema_decay=0.5))
    for step in range(1, 4):
        _step(unet, step)
        ema.update(step)
    trained = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
    with ema.swapped_in():
        written = family.export_lora(unet, tmp_path, {}, {})
    exported = load_file(written[0])
    for name, average in ema.average.items():
        key = "unet." + name.replace(".default", "")
        assert torch.equal(exported[key], average) and not torch.equal(average, trained[name]), key
    assert all(torch.equal(p, trained[n]) for n, p in unet.named_parameters() if p.requires_grad)


def test_export_writes_the_trained_and_the_averaged_pissa_adapter_for_the_original_base(tiny_model, tmp_path):
    """export_adapter: the trained adapter's files, and the EMA's in ema/; a PiSSA adapter in its
    plain-LoRA form, so diffusers' fuse_lora on the original model gives each one's merged weights."""
    from diffusers import StableDiffusionPipeline

    from lorapipe.stages.lora_formats.diffusers_format import peft_state_dict
    from lorapipe.stages.lora_formats.lycoris import adapted_modules
    from lorapipe.stages.train.exports import export_adapter

    family = families.for_model(tiny_model)
    params = AdapterParams(init="pissa", rank=2, alpha=3)
    unet = family.load_denoiser(tiny_model, torch.float32)
    unet.requires_grad_(False)
    unet.add_adapter(peft_config(params, family.lora_target_modules(unet, "attention")))
    initial = {k: v.clone() for k, v in peft_state_dict(unet).items()}
    ema = AdapterEMA(unet, EMAParams(ema_decay=0.5))
    for step in range(1, 4):
        _step(unet, step)
        ema.update(step)
    written = export_adapter(family, unet, tmp_path, {}, {}, params, initial, ema)
    names = [f"pytorch_lora_weights{kind}.safetensors" for kind in ("", "_kohya", "_comfyui")]
    assert [str(p.relative_to(tmp_path)) for p in written] == names + [f"ema/{name}" for name in names]
    with ema.swapped_in():
        averaged = merged(unet)
    for lora, expected in ((written[0], merged(unet)), (written[3], averaged)):
        pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
        pipe.load_lora_weights(lora.parent, weight_name=lora.name)
        pipe.fuse_lora()
        for name in adapted_modules(unet):
            assert torch.allclose(pipe.unet.get_submodule(name).weight, weight(expected, name), atol=1e-5), name
