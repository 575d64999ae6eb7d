"""benchmarks/gpu_bench.py: the full-size architecture configs it builds the flow-matching models
from, and its smoke mode: the GPU benchmark's code, every setting (SD1.5, SDXL, Flux.1 with and
without gradient checkpointing, Flux.1 with an nf4 base, Flux.2-klein, Z-Image, Flux.2-klein and
Wan 2.1 on clips with block swap; group offloading as the last variant of the Flux.1 ones) on the
tiny model of its family on the CPU, so that the script a lent GPU will run is known to work. It prints its figures and must leave
BENCHMARKS.md alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorapipe.stages import families
from lorapipe.stages.families.folders import component_class
from lorapipe.stages.families.single_file import ARCH_ROOT

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {  # setting -> the cached-step variants its smoke run measures
    "sd15": ("sdpa", "classic"), "sdxl": ("sdpa",), "flux1": ("sdpa", "sdpa+offload"),
    "flux1-nf4": ("sdpa", "sdpa+offload"), "flux1-no-checkpointing": ("sdpa",), "flux2-klein": ("sdpa",), "z-image": ("sdpa",),
    "flux2-klein-9b-swap": ("sdpa",), "wan2.1-14b-swap": ("sdpa",),
}
RATES = {
    "encode": ("stage_img_s", "bare_img_s", "ratio"),
    "train steps": ("cached_step_ms", "cached_it_s", "bare_step_ms", "on_the_fly_step_ms", "loader_samples_s",
                    "loader_over_consumption", "cached_over_bare", "on_the_fly_over_cached"),
}
VARIANT_RATES = ("step_ms", "it_s", "tflop_per_step", "achieved_tflop_s")
PUBLISHED = {  # arch folder -> (family, variant), parameters by component (Flux.1-dev 12B with T5-XXL;
    # Flux.2-klein base 4B with Qwen3-4B; Z-Image 6B with Qwen3-4B; Flux.1's VAE for both; Wan 2.1 T2V 14B
    # with UMT5-XXL's encoder and Wan 2.1's VAE; SD2.1 768-v with OpenCLIP ViT-H's text tower less its last layer)
    "flux1": (("flux1", "dev"), {"transformer": 11_901_408_320, "text_encoder_2": 4_762_310_656,
                                 "text_encoder": 123_060_480, "vae": 83_819_683}),
    "flux2-klein": (("flux2-klein", "base"), {"transformer": 3_875_544_576, "text_encoder": 4_022_468_096,
                                              "vae": 84_046_115}),
    "flux2-klein-9b": (("flux2-klein", "base"), {"transformer": 9_078_581_248, "text_encoder": 8_190_735_360,
                                                 "vae": 84_046_115}),
    "z-image": (("z-image", "base"), {"transformer": 6_154_908_736, "text_encoder": 4_022_468_096,
                                      "vae": 83_819_683}),
    "wan2.1-14b": (("wan", "2.1-t2v"), {"transformer": 14_288_491_584, "text_encoder": 5_680_910_336,
                                        "vae": 126_892_531}),
    "sd21": (("sd15", "sd15"), {"unet": 865_910_724, "text_encoder": 340_387_840, "vae": 83_653_863}),
    # issue 41's rows: Flux.1 Kontext dev (Flux.1-dev's sizes); Qwen-Image 20B with Qwen2.5-VL-7B, its edit
    # pipelines the same weights' sizes; Wan 2.1 T2V 1.3B and Wan 2.2 TI2V-5B (Wan 2.2's VAE); LTX-2 19B with
    # Gemma 3 12B, its text connectors, video and audio VAEs and vocoder
    "flux1-kontext": (("flux1-kontext", "dev"), {"transformer": 11_901_408_320, "text_encoder_2": 4_762_310_656,
                                                 "text_encoder": 123_060_480, "vae": 83_819_683}),
    **{arch: ((arch, arch), {"transformer": 20_430_401_088, "text_encoder": 8_292_166_656, "vae": 126_892_531})
       for arch in ("qwen-image", "qwen-image-edit", "qwen-image-edit-plus")},
    "wan2.1-1.3b": (("wan", "2.1-t2v"), {"transformer": 1_418_996_800, "text_encoder": 5_680_910_336,
                                         "vae": 126_892_531}),
    "wan2.2-ti2v-5b": (("wan", "2.2-ti2v-5b"), {"transformer": 4_999_787_712, "text_encoder": 5_680_910_336,
                                                "vae": 704_688_668}),
    # Qwen-Image 2.1 (7.1B single-stream) with Qwen3-VL-8B; Krea 2 Raw (the base) with Qwen3-VL-4B, Qwen-Image's VAE
    "qwen-image-2.1": (("qwen-image-2.1", "qwen-image-2.1"), {"transformer": 7_115_124_736,
                                                              "text_encoder": 8_767_123_696, "vae": 337_740_404}),
    "krea2": (("krea2", "base"), {"transformer": 12_820_073_036, "text_encoder": 4_437_815_808,
                                  "vae": 126_892_531}),
    "ltx2": (("ltx2", "2"), {"transformer": 18_876_174_592, "text_encoder": 12_187_325_040,
                             "connectors": 1_431_475_200, "vae": 1_222_479_601, "audio_vae": 53_248_146,
                             "vocoder": 55_592_802}),
}


@pytest.mark.parametrize("arch", PUBLISHED)
def test_shipped_architectures_have_the_published_sizes_and_variants(arch):
    import torch

    (family, variant), sizes = PUBLISHED[arch]
    bound = families.for_model(ARCH_ROOT / arch)
    assert (bound.name, bound.variant.name) == (family, variant)
    counted = {}
    for name, size in sizes.items():
        cls, config = component_class(ARCH_ROOT / arch, name), ARCH_ROOT / arch / name  # LTX-2's "ltx2" modules too
        with torch.device("meta"):  # accelerate's init_empty_weights unties T5's shared embedding
            model = cls.from_config(cls.load_config(config)) if hasattr(cls, "load_config") else cls(
                cls.config_class.from_pretrained(config))
        counted[name] = sum(p.numel() for p in model.parameters())
    assert counted == sizes


def test_every_shipped_architecture_is_pinned():
    """A folder added to stages/assets/arch gets its published sizes pinned here (SD1.5's and SDXL's
    in tests/test_single_file.py)."""
    assert {folder.name for folder in ARCH_ROOT.iterdir()} == set(PUBLISHED) | {"sd15", "sdxl"}


@pytest.mark.slow
def test_smoke_prints_every_figure_for_every_setting_and_leaves_benchmarks_md_alone(tmp_path):
    benchmarks_md = REPO / "BENCHMARKS.md"
    before = benchmarks_md.read_bytes()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    only = [arg for name in SETTINGS for arg in ("--only", name)]  # every setting, each named as --only takes it
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_bench", "--smoke", "--root", str(tmp_path), *only],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"measurement"')]
    figures = {p.pop("measurement"): p for p in printed}
    expected = {f"{name} {what}" for name, variants in SETTINGS.items()
                for what in ("model", *RATES, *(f"cached step {v}" for v in variants))}
    assert set(figures) == expected
    for name, variants in SETTINGS.items():
        for what, keys in RATES.items():
            assert all(figures[f"{name} {what}"][key] > 0 for key in keys), (name, what, figures[f"{name} {what}"])
        for variant in variants:
            step = figures[f"{name} cached step {variant}"]
            assert all(step[key] > 0 for key in VARIANT_RATES), (name, variant, step)
            assert step["mfu"] is None  # no bf16 peak is known for a CPU
        assert "mfu_note" in figures[f"{name} train steps"]
    # Flux.1 with and without gradient checkpointing: the same tiny model, and the checkpointed step
    # recomputes its forward in the backward
    assert figures["flux1 model"]["arch"] == figures["flux1-no-checkpointing model"]["arch"] == "flux1"
    checkpointed, plain = figures["flux1 train steps"], figures["flux1-no-checkpointing train steps"]
    assert checkpointed["gradient_checkpointing"] and not plain["gradient_checkpointing"]
    assert (figures["flux1 cached step sdpa"]["tflop_per_step"]
            > figures["flux1-no-checkpointing cached step sdpa"]["tflop_per_step"])
    assert figures["flux1-nf4 train steps"]["base_quantization"] == "nf4"
    assert figures["flux2-klein-9b-swap train steps"]["blocks_to_swap"] == 0.5
    assert figures["wan2.1-14b-swap train steps"]["frames"] == 5  # clips, of the tiny Wan's frame rule
    assert benchmarks_md.read_bytes() == before


def test_a_failing_setting_is_reported_in_one_line_and_the_next_settings_still_run(tmp_path):
    import dataclasses

    import torch

    from benchmarks import gpu_bench

    missing = gpu_bench.Setting("no-such-arch", 64, 2, 8, 4, ("sdpa",))
    mode = dataclasses.replace(gpu_bench.SMOKE, settings={"first": missing, "second": missing})
    threads = torch.get_num_threads()
    try:
        printed = list(gpu_bench.measurements(mode, ["first", "second"], tmp_path))
    finally:
        torch.set_num_threads(threads)  # measurements runs the CPU on one thread
    assert [name for name, _ in printed] == ["first error", "second error"]
    assert "no-such-arch/model_index.json not found" in printed[0][1]["error"]
