"""The tiny offline HunyuanVideo 1.5 (text-to-video) that the family will be checked against: built
twice byte for byte, loaded and run by diffusers' HunyuanVideo15Pipeline, with a text encoder whose
tapped hidden state is a layer's output (so a record of the wrong layer differs)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_checks import quiet_pipeline

from lorapipe.stages.families.tiny.hunyuanvideo15 import build_tiny_hunyuanvideo15


@pytest.fixture(scope="module")
def tiny_hunyuanvideo15(tmp_path_factory) -> Path:
    return build_tiny_hunyuanvideo15(tmp_path_factory.mktemp("hunyuanvideo15"))


def test_tiny_hunyuanvideo15_builds_byte_identically(tiny_hunyuanvideo15, tmp_path):
    again = build_tiny_hunyuanvideo15(tmp_path / "again")
    files = sorted(str(p.relative_to(tiny_hunyuanvideo15)) for p in tiny_hunyuanvideo15.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(again)) for p in again.rglob("*") if p.is_file())
    assert {"transformer/diffusion_pytorch_model.safetensors", "text_encoder_2/model.safetensors",
            "tokenizer_2/tokenizer_config.json", "guider/guider_config.json"} <= set(files)
    for rel in files:
        assert (tiny_hunyuanvideo15 / rel).read_bytes() == (again / rel).read_bytes(), rel


def test_tiny_hunyuanvideo15_renders_a_clip_through_its_pipeline(tiny_hunyuanvideo15):
    pipe = quiet_pipeline(tiny_hunyuanvideo15)
    assert type(pipe).__name__ == "HunyuanVideo15Pipeline"
    frames = pipe('a sign that says "hi"', height=32, width=32, num_frames=5, num_inference_steps=2,
                  generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (1, 5, 32, 32, 3)
    tokens = pipe.tokenizer("a rocket", return_tensors="pt").input_ids
    hidden = pipe.text_encoder(input_ids=tokens, output_hidden_states=True).hidden_states
    assert not torch.equal(hidden[-3], hidden[0])  # the pipeline's tapped layer is not the embeddings
