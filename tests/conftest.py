"""Session fixtures shared by the whole suite: one tiny model and one encoded set per session."""
from __future__ import annotations

import functools
import os
import shutil
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.update({
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
})


def pytest_configure(config):
    """Ctrl-C reaches the commands the tests start as it does from a terminal: a suite started as a
    background job (`cmd &` in a script, as CI may) inherits SIGINT ignored, and every child would
    too (the Ctrl-C tests then passed only after an in-process flow, whose anyio runner reinstalls
    Python's handler). Under pytest-xdist (make test: docs/testing.md) each worker's own torch work
    gets its share of the cores, so that two workers do not run two threads each on CI's 2 cores."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        import torch

        from lorapipe.stages.processes.cpu_threads import usable_cores

        torch.set_num_threads(max(1, usable_cores() // int(worker["workercount"])))


LIBRARY_WARNINGS_SHOWN = {"TRANSFORMERS_VERBOSITY": "warning", "DIFFUSERS_VERBOSITY": "warning"}  # as for a user
REPO = Path(__file__).resolve().parent.parent
# `python -m lorapipe.flows.cli ARGS...`, printing at its exit which of these modules its own process had loaded
LOADED_AT_EXIT = """
import atexit, runpy, sys
names = ("torch", "diffusers", "transformers", "bitsandbytes", "torchao")
atexit.register(lambda: print("loaded:", sorted(n for n in names if sys.modules.get(n)), file=sys.stderr))
sys.argv[0] = "lorapipe"
runpy.run_module("lorapipe.flows.cli", run_name="__main__")
"""
MODULAR_INDEX = "modular_model_index.json"  # its entries name the folder it was saved into


def copy_model(model: Path, to: Path) -> Path:
    """A copy of a model folder; a modular one's index pointed at the copy, as saving it there writes it
    (a moved modular folder is refused: stages/families/folders.py)."""
    shutil.copytree(model, to)
    if (to / MODULAR_INDEX).is_file():
        (to / MODULAR_INDEX).write_text((model / MODULAR_INDEX).read_text().replace(str(model), str(to)))
    return to


# What a demo run trains and renders in the tests that are not about the shipped demo itself (test_demo's
# demo_runs runs it as shipped): enough for every tiny model's LoRA to beat its base (docs/testing.md).
FEWER_STEPS = ("--set", "train.max_steps=60", "--set", "evaluate.num_inference_steps=2")
DEMO_IMAGES = REPO / "stages" / "assets" / "demo_images"


@dataclass(frozen=True)
class EncodedSet:
    artifact_dir: Path
    cache_root: Path
    digest: str


@contextmanager
def _count_encoder_rows():
    """Rows pushed through the VAE encoder and through each text encoder (CLIP, T5: a Flux.1 caption
    is two rows; Qwen3: Z-Image, Flux.2-klein; Qwen2.5-VL: Qwen-Image and its edit models; Qwen3-VL: Qwen-Image 2.1, Krea 2, Ideogram 4; UMT5: Wan;
    Gemma 3: LTX-2; Mistral3: Flux.2-dev; Llama: HiDream-I1 (with two CLIPs and T5); Qwen2.5-VL's language model called with token ids, not inside Qwen2.5-VL:
    HunyuanVideo 1.5 and HunyuanImage 2.1, whose ByT5, a T5, runs only on quoted text), whatever calls them. Wan's and Qwen-Image's 3-D VAEs encode a clip in chunks, the
    first of one frame: a clip (or an image) is counted at that chunk. Qwen3-VL is counted at its first
    decoder layer, which every caller runs once a batch (Ideogram4Pipeline runs the layers itself)."""
    import torch

    counts = {"vae": 0, "text": 0}

    def hook(module, args, kwargs, output):
        name = type(module).__name__
        if name in ("Encoder", "LTX2VideoEncoder3d", "QwenImage21Encoder3d", "HunyuanVideo15Encoder3D",
                    "HunyuanImageEncoder2D", "HunyuanVideoEncoder3D") and \
                type(module).__module__.startswith("diffusers"):
            counts["vae"] += args[0].shape[0]
        elif name in ("WanEncoder3d", "QwenImageEncoder3d") and args[0].shape[2] == 1:
            counts["vae"] += args[0].shape[0]
        elif name in ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel", "Qwen3Model",
                      "UMT5EncoderModel", "Gemma3ForConditionalGeneration", "Qwen2_5_VLModel",
                      "Mistral3Model", "LlamaForCausalLM") or \
                name == "Qwen2_5_VLTextModel" and kwargs.get("input_ids") is not None:
            ids = args[0] if args else kwargs["input_ids"]
            counts["text"] += ids.shape[0]
        elif name == "Qwen3VLTextDecoderLayer" and module.self_attn.layer_idx == 0:
            counts["text"] += args[0].shape[0]

    handle = torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)
    try:
        yield counts
    finally:
        handle.remove()


@pytest.fixture(scope="session")
def count_encoder_rows():
    """Counts encodes by hooking forward calls, not by trusting a stage's own counters."""
    return _count_encoder_rows


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """A function arch -> the tiny model of that arch, built once a session (never write into it:
    copy it first)."""
    from lorapipe.stages.families import build_tiny_model

    built: dict[str, Path] = {}

    def tiny(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(tmp_path_factory.mktemp("models") / f"tiny-{arch}", arch)
        return built[arch]

    return tiny


@pytest.fixture(scope="session")
def exported_loras(tmp_path_factory, tiny_models):
    """A function (arch, targets) -> the tiny denoiser of that arch with a trained LoRA on `targets` (a
    preset, or family_checks.EVERY_LINEAR), those targets and the files its family exports from it,
    made once a session: tests that read the same export share it (never write into it)."""
    from family_checks import exported_lora

    @functools.cache
    def exported(arch: str, targets: str = "all_linear") -> tuple:
        return exported_lora(tiny_models(arch), targets, tmp_path_factory.mktemp(f"{arch}-lora"))

    return exported


@pytest.fixture(scope="session")
def encoded_baselines(tmp_path_factory, tiny_models, count_encoder_rows):
    """A function arch -> a folder with the tiny model of that arch and the demo photos (model/,
    data/) encoded into its cache (cache/), made once a session: the invalidation tests copy its model
    and data over that cache."""
    from invalidation_checks import TEXT_ROWS, encoded_baseline

    @functools.cache
    def baseline(arch: str) -> Path:
        return encoded_baseline(tmp_path_factory.mktemp(f"{arch}-baseline"), tiny_models(arch), DEMO_IMAGES,
                                count_encoder_rows, TEXT_ROWS.get(arch, 1))

    return baseline


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    return tiny_models("sd15")


@pytest.fixture(scope="session")
def sdxl_model(tiny_models) -> Path:
    return tiny_models("sdxl")


@pytest.fixture(scope="session")
def flux_model(tiny_models) -> Path:
    """The tiny Flux.1 dev (guidance input, 512 T5 tokens)."""
    return tiny_models("flux1")


@pytest.fixture(scope="session")
def flux_schnell_model(tiny_models) -> Path:
    return tiny_models("flux1-schnell")


@pytest.fixture(scope="session")
def flux_kontext_model(tiny_models) -> Path:
    """The tiny Flux.1 Kontext: the tiny Flux.1 dev's weights in a FluxKontextPipeline folder."""
    return tiny_models("flux1-kontext")


@pytest.fixture(scope="session")
def zimage_model(tiny_models) -> Path:
    """The tiny Z-Image base (the model to train on)."""
    return tiny_models("z-image")


@pytest.fixture(scope="session")
def zimage_turbo_model(tiny_models) -> Path:
    """The tiny Z-Image Turbo (step-distilled: render with it, train on the base)."""
    return tiny_models("z-image-turbo")


@pytest.fixture(scope="session")
def flux2_model(tiny_models) -> Path:
    """The tiny Flux.2-klein base (the model to train on)."""
    return tiny_models("flux2-klein")


@pytest.fixture(scope="session")
def qwenimage_model(tiny_models) -> Path:
    return tiny_models("qwen-image")


@pytest.fixture(scope="session")
def qwenimage_edit_model(tiny_models) -> Path:
    return tiny_models("qwen-image-edit")


@pytest.fixture(scope="session")
def qwenimage21_model(tiny_models) -> Path:
    return tiny_models("qwen-image-2.1")


@pytest.fixture(scope="session")
def krea2_model(tiny_models) -> Path:
    return tiny_models("krea2")


@pytest.fixture(scope="session")
def ideogram4_model(tiny_models) -> Path:
    return tiny_models("ideogram4")


@pytest.fixture(scope="session")
def demo_images() -> Path:
    return DEMO_IMAGES


@pytest.fixture(scope="session")
def tiny_config(tiny_model):
    """A function that writes FOLDER/config.yaml for a whole `lorapipe run` of the tiny model over a
    copy of the demo photos (FOLDER/data) at 64 px, its cache and outputs in FOLDER; `train` settings
    as given."""
    import shutil

    import yaml

    def write(folder: Path, name: str, **train) -> Path:
        shutil.copytree(DEMO_IMAGES, folder / "data")
        (folder / "config.yaml").write_text(yaml.safe_dump({
            "name": name, "cache_dir": "cache", "output_dir": "out", "model": {"path": str(tiny_model)},
            "data": {"path": "data"}, "preprocess": {"resolution": 64, "holdout_fraction": 0.25},
            "encode": {"num_workers": 0}, "train": train,
            "evaluate": {"prompts": ["a photo of a cat"], "seeds": [0], "num_inference_steps": 2},
        }))
        return folder / "config.yaml"

    return write


@pytest.fixture(scope="session")
def run_stages():
    """A function that serves or builds a config's stages in-process (no Prefect, which only wraps
    the same calls in tasks), their jobs where `placements` say (by stage; default: where their
    settings say): stage -> (StageResult, Artifact)."""
    from lorapipe.flows.config import load_config
    from lorapipe.flows.steps import Context
    from lorapipe.flows.runner import run_stage

    def run(config_path: Path, stages: tuple[str, ...], placements: dict | None = None) -> dict:
        ctx = Context(load_config(config_path), log=lambda line: None, placements=placements)
        done, upstream = {}, {}
        try:
            for stage in stages:
                done[stage] = run_stage(ctx, stage, upstream)
                upstream[stage] = done[stage][1]
        finally:
            ctx.close()
        return done

    return run


def _encode_demo_images(root: Path, model: Path, params, sources: tuple | None = None,
                        placement=None, video=None) -> EncodedSet:
    """The demo photos (or these DatasetSources) at 64 px through the real preprocess and encode
    stages (the demo photos: 6 train, 2 held out); encoded where `placement` says (default: here);
    clips sampled as `video` says (preprocess.VideoSampling; default: its defaults)."""
    from lorapipe.cache.digest import StatCache
    from lorapipe.cache.store import ArtifactStore, StageKey
    from lorapipe.stages import encode, families, preprocess
    from lorapipe.stages.models import component_digests

    store = ArtifactStore(root)
    with StatCache(root / "stat.sqlite") as stat_cache:
        pre_params = preprocess.PreprocessParams(resolution=64, holdout_fraction=0.25,
                                                 video=video or preprocess.VideoSampling())
        sources = sources or (preprocess.DatasetSource(path=DEMO_IMAGES),)
        inputs = preprocess.PreprocessInputs(sources, stat_cache)
        ingredients = preprocess.dataset_ingredients(sources, pre_params, stat_cache)
        pre, _ = store.build(StageKey("preprocess", {"p": pre_params.model_dump(), "data": ingredients}),
                             lambda out, work: preprocess.run(pre_params, inputs, out, work), {})
        family = families.for_model(model)
        digests = component_digests(model, stat_cache, family)
    enc_inputs = encode.EncodeInputs(pre.path, sources, root, model, family.name, digests)
    enc, _ = store.build(
        StageKey("encode", {"pre": pre.digest}),
        lambda out, work: encode.run(params, enc_inputs, out, work, encode.EncodeOptions(num_workers=0),
                                     placement=placement), {})
    return EncodedSet(enc.path, root, enc.digest)


@pytest.fixture(scope="session")
def encoded(tmp_path_factory, tiny_model) -> EncodedSet:
    from lorapipe.stages.encode import EncodeParams

    return _encode_demo_images(tmp_path_factory.mktemp("encoded-cache"), tiny_model, EncodeParams())


@pytest.fixture(scope="session")
def sdxl_encoded(tmp_path_factory, sdxl_model) -> EncodedSet:
    """Through the tiny SDXL model, each image also encoded mirrored (encode.flip)."""
    from lorapipe.stages.encode import EncodeParams

    return _encode_demo_images(tmp_path_factory.mktemp("sdxl-encoded-cache"), sdxl_model, EncodeParams(flip=True))


@pytest.fixture
def encoded_copy(tmp_path, encoded) -> EncodedSet:
    """A private copy of the encoded set and its sample store, for tests that damage it."""
    root = tmp_path / "encoded-copy"
    shutil.copytree(encoded.cache_root, root)
    return EncodedSet(root / Path(encoded.artifact_dir).relative_to(encoded.cache_root), root, encoded.digest)


def _damage_in_place(store, record) -> Path:
    """Flip one bit inside a record's stored tensors; its shard keeps its size. Returns the shard."""
    offset, size, _ = record.location.members["safetensors"]
    shard = store.shard_path(record.location.shard)
    damaged = bytearray(shard.read_bytes())
    damaged[offset + size // 2] ^= 0x01
    shard.write_bytes(bytes(damaged))
    return shard


@dataclass(frozen=True)
class S3Server:
    env: dict[str, str]  # the AWS_* variables that reach it (any credentials are accepted)
    bucket: str

    def url(self, name: str) -> str:
        """A prefix of the test bucket (give each test its own)."""
        return f"s3://{self.bucket}/{name}"


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> str:
    """One kept Prefect server for the session (tests/prefect_server.py): its API URL."""
    from prefect_server import kept_server

    with kept_server(tmp_path_factory.mktemp("prefect-server"), dict(os.environ)) as api:
        yield api


@pytest.fixture(scope="module")
def on_kept_prefect_server(prefect_api):
    """A module's commands run their flows on the session's kept server (PREFECT_API_URL in this
    process's environment, which the commands inherit) instead of each starting a temporary one;
    for a module, `pytestmark = pytest.mark.usefixtures("on_kept_prefect_server")`. Prefect, once
    imported, holds its settings from the environment of that moment: they are refreshed on entry
    and on exit, so no later module in this worker sees the kept server's URL."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_API_URL", prefect_api)
        _refresh_prefect_settings()
        yield prefect_api
    _refresh_prefect_settings()


def _refresh_prefect_settings() -> None:
    if "prefect.context" in sys.modules:
        sys.modules["prefect.context"].refresh_global_settings_context()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS for the whole session (benchmarks/seaweed.py); its AWS_* variables are set in
    this process while it runs, and child processes inherit them."""
    from benchmarks.seaweed import seaweedfs

    with seaweedfs(tmp_path_factory.mktemp("seaweedfs"), "lorapipe-tests") as env:
        yield S3Server(env, "lorapipe-tests")


@pytest.fixture(scope="session")
def damage_in_place():
    """damage_in_place(sample_store, record) -> the damaged shard's path."""
    return _damage_in_place


@pytest.fixture(scope="session")
def flux_encoded(tmp_path_factory, flux_model) -> EncodedSet:
    """The demo photos at 64 px through the tiny Flux.1 dev."""
    from lorapipe.stages.encode import EncodeParams

    return _encode_demo_images(tmp_path_factory.mktemp("flux-encoded-cache"), flux_model, EncodeParams())


def _demo_encoded(model_fixture: str, label: str):
    """A session fixture: the demo photos at 64 px through the tiny model `model_fixture` returns."""
    @pytest.fixture(scope="session")
    def encoded_set(tmp_path_factory, request) -> EncodedSet:
        from lorapipe.stages.encode import EncodeParams

        model = request.getfixturevalue(model_fixture)
        return _encode_demo_images(tmp_path_factory.mktemp(f"{model_fixture}-encoded-cache"), model, EncodeParams())

    encoded_set.__doc__ = f"The demo photos at 64 px through the tiny {label}."
    return encoded_set


@pytest.fixture(scope="session")
def wan_model(tiny_models) -> Path:
    return tiny_models("wan2.1")


@pytest.fixture(scope="session")
def wan_clips_encoded(tmp_path_factory, wan_model) -> EncodedSet:
    """The demo clips (stages/demo/clips.py: 4 train, 2 held out) through the tiny Wan 2.1, one
    window of 9 frames at 16 fps each."""
    from lorapipe.stages.demo.clips import write_demo_clips
    from lorapipe.stages.encode import EncodeParams
    from lorapipe.stages.preprocess import DatasetSource, VideoSampling

    clips = write_demo_clips(tmp_path_factory.mktemp("demo-clips"))[0].parent
    return _encode_demo_images(tmp_path_factory.mktemp("wan-clips-encoded-cache"), wan_model, EncodeParams(),
                               (DatasetSource(path=clips),),
                               video=VideoSampling(fps=16, num_frames=9))


flux2_encoded = _demo_encoded("flux2_model", "Flux.2-klein base")
zimage_encoded = _demo_encoded("zimage_model", "Z-Image base")
qwenimage_encoded = _demo_encoded("qwenimage_model", "Qwen-Image")
qwenimage21_encoded = _demo_encoded("qwenimage21_model", "Qwen-Image 2.1")
krea2_encoded = _demo_encoded("krea2_model", "Krea 2 base")
ideogram4_encoded = _demo_encoded("ideogram4_model", "Ideogram 4")


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's chromium (tests/browser.py), installed when missing: the UI checks never skip."""
    from browser import installed_chromium

    return installed_chromium()


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> Path:
    """A CLIP model with random weights and the byte-level tokenizer, saved offline."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    from lorapipe.stages.families.tiny.clip import write_tokenizer

    out = tmp_path_factory.mktemp("models") / "tiny-clip"
    tokenizer = write_tokenizer(out.parent / "clip-tokenizer-src")
    vocab = len(tokenizer.get_vocab())
    layers = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2)
    config = CLIPConfig(
        text_config=dict(**layers, vocab_size=vocab, max_position_embeddings=77, bos_token_id=vocab - 2,
                         eos_token_id=vocab - 1, pad_token_id=vocab - 1),
        vision_config=dict(**layers, image_size=32, patch_size=8), projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(out)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    shutil.rmtree(out.parent / "clip-tokenizer-src")
    return out


@pytest.fixture(scope="session")
def tiny_captioner(tmp_path_factory) -> Path:
    """The tiny Qwen2.5-VL captioner (stages/families/tiny/captioner.py)."""
    from lorapipe.stages.families.tiny.captioner import build_tiny_captioner

    return build_tiny_captioner(tmp_path_factory.mktemp("models") / "tiny-captioner")


@contextmanager
def _count_generated_rows():
    """Images captioned: the rows of every Qwen2-VL / Qwen2.5-VL generate() call, whoever makes it."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    counts = {"calls": 0, "rows": 0}
    generate = Qwen2_5_VLForConditionalGeneration.generate

    def counted(self, *args, **kwargs):
        counts["calls"] += 1
        counts["rows"] += kwargs["input_ids"].shape[0]
        return generate(self, *args, **kwargs)

    Qwen2_5_VLForConditionalGeneration.generate = counted
    try:
        yield counts
    finally:
        Qwen2_5_VLForConditionalGeneration.generate = generate


@pytest.fixture(scope="session")
def count_generated_rows():
    return _count_generated_rows
