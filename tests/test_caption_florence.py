"""The Florence-2 captioner on the tiny offline Florence-2: it builds byte-identically and loads through
transformers, and its captions are what the documented generate() usage gives for the same images."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from lorapipe.cache.errors import UserError
from lorapipe.stages.caption import CaptionParams
from lorapipe.stages.caption.captioners import load_captioner
from lorapipe.stages.caption.florence import DEFAULT_NUM_BEAMS, DEFAULT_PROMPT, FlorenceCaptioner
from lorapipe.stages.families.tiny.florence import build_tiny_florence

DEMO_IMAGES = Path(__file__).resolve().parents[1] / "stages" / "assets" / "demo_images"
MAX_NEW_TOKENS = 64
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, "num_beams": 1}


@pytest.fixture(scope="module")
def florence(tmp_path_factory) -> Path:
    return build_tiny_florence(tmp_path_factory.mktemp("florence"))


@pytest.fixture(scope="module")
def captioner(florence) -> FlorenceCaptioner:
    """Greedy, one beam."""
    return FlorenceCaptioner(florence, GREEDY, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    return [Image.open(DEMO_IMAGES / f"{name}.jpg").convert("RGB") for name in ("astronaut", "camera", "coffee")]


def bare_generate(captioner: FlorenceCaptioner, images: list, prompt: str) -> torch.Tensor:
    """transformers' documented Florence-2 call on these images as one batch, with the captioner's
    generate() arguments."""
    inputs = captioner.processor(text=[prompt] * len(images), images=images, return_tensors="pt")
    with torch.no_grad():
        return captioner.model.generate(**inputs, **captioner.generation)


def test_tiny_florence_builds_byte_identically_and_loads_offline(florence, tmp_path):
    from transformers import AutoConfig, Florence2ForConditionalGeneration

    again = build_tiny_florence(tmp_path / "again")
    files = sorted(str(p.relative_to(florence)) for p in florence.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(again)) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (florence / rel).read_bytes() == (again / rel).read_bytes(), rel
    assert AutoConfig.from_pretrained(florence).model_type == "florence2"
    assert isinstance(Florence2ForConditionalGeneration.from_pretrained(florence), Florence2ForConditionalGeneration)


@pytest.mark.parametrize("beams", [1, 3])
def test_captions_are_the_bare_generate_loops_batched_and_one_at_a_time(florence, captioner, images, beams):
    """Greedy, and with the three beams of the documented usage (the stage's default)."""
    if beams != 1:
        captioner = load_captioner(florence, CaptionParams(max_new_tokens=MAX_NEW_TOKENS), "cpu", torch.float32)
        assert captioner.generation == {**GREEDY, "num_beams": beams}
    captions = captioner(images, DEFAULT_PROMPT)

    batch = bare_generate(captioner, images, DEFAULT_PROMPT)
    pad = captioner.model.generation_config.pad_token_id
    assert len({int((row != pad).sum()) for row in batch}) > 1  # some rows end early: the batch is padded
    assert captions == [text.strip() for text in captioner.processor.batch_decode(batch, skip_special_tokens=True)]

    for image, caption in zip(images, captions):  # the documented single-image call, word for word
        generated = bare_generate(captioner, [image], DEFAULT_PROMPT)
        text = captioner.processor.batch_decode(generated, skip_special_tokens=False)[0]
        parsed = captioner.processor.post_process_generation(text, task=DEFAULT_PROMPT, image_size=image.size)
        assert caption == parsed[DEFAULT_PROMPT]
    assert len(set(captions)) == len(captions) and all(captions)


def test_the_default_prompt_is_a_caption_task(captioner):
    assert DEFAULT_PROMPT in captioner.processor.task_prompts_without_inputs
    assert captioner.processor.tasks_answer_post_processing_type[DEFAULT_PROMPT] == "pure_text"


def test_prompts_go_through_the_processors_task_handling(captioner, images):
    question = captioner.processor.task_prompts_without_inputs["<CAPTION>"]  # "What does the image describe?"
    assert captioner(images, "<CAPTION>") == captioner(images, question)
    assert captioner(images, "<CAPTION>") != captioner(images, DEFAULT_PROMPT)
    with pytest.raises(UserError, match="caption.prompt: <OD> is a Florence-2 description_with_bboxes task"):
        captioner(images, "<OD>")
    with pytest.raises(UserError, match="caption.prompt: Task token <CAPTION> should be the only content"):
        captioner(images, "<CAPTION> of a cat")


def test_the_caption_stage_captions_with_florence(tmp_path, florence, tiny_model, demo_images, captioner):
    """A Florence-2 folder as caption.model: the stage dispatches on its model_type, prompts with the
    caption task by default, and the captions are what the captioner makes of the upright photos."""
    from test_caption import UPTO_CAPTION, captions_of, half_captioned, raw_config
    from test_invalidation import run_all

    from lorapipe.flows.config import validate_config

    data = half_captioned(demo_images, tmp_path / "data")
    config = validate_config(raw_config(tmp_path, tiny_model, data, tmp_path / "cache", florence,
                                        max_new_tokens=MAX_NEW_TOKENS), "test")
    captions = captions_of(run_all(config, UPTO_CAPTION))
    assert captions["captioner"]["model_type"] == "florence2" and captions["captioner"]["prompt"] == DEFAULT_PROMPT
    assert captions["captioner"]["settings"]["num_beams"] == DEFAULT_NUM_BEAMS  # resolved: in the key
    generated = {i: e["generated"] for i, e in captions["samples"].items() if e["source"] == "generated"}
    photos = [Image.open(data / f"{name}.jpg").convert("RGB") for name in sorted(generated)]
    beams = load_captioner(florence, CaptionParams(max_new_tokens=MAX_NEW_TOKENS), "cpu", torch.float32)
    assert list(generated.values()) == [beams([photo], DEFAULT_PROMPT)[0] for photo in photos]
