"""Every bad input a user can cause ends `lorapipe run` with one line naming the file or key and
what to do, a non-zero exit code, and no traceback on the terminal; the traceback is in the run's
log file, whose path the line before says. Nothing already cached is lost. (Issue 12, items 8, 10.)

One row per bad input, each a real `python -m lorapipe.flows.cli run` over one shared cache (preprocess,
encode and a train with two checkpoints, built in-process). Errors found before the run starts
print exactly one line and start no Prefect server; rows marked `in_flow` fail inside a Prefect
task, which shows that Prefect's own tracebacks and repeats stay off the terminal.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from lorapipe.cache.store import ArtifactStore
from lorapipe.flows.steps import STAGES
from mounts import tmpfs
from permissions import as_a_plain_user
from lorapipe.stages.train.checkpoints import CheckpointDir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("on_kept_prefect_server")]
REPO = Path(__file__).resolve().parent.parent
MAX_FLOW_LINES = 20  # Prefect's progress lines for three stages, the log's path, the error


@dataclass(frozen=True)
class Workspace:
    root: Path
    config: Path
    model: Path
    checkpoints: Path  # the baseline train's work directory's checkpoints

    @property
    def cache(self) -> Path:
        return self.root / "cache"


@pytest.fixture(scope="module")
def ws(tmp_path_factory, tiny_model, tiny_config, run_stages) -> Workspace:
    root = tmp_path_factory.mktemp("bad-input")
    config = tiny_config(root, "bad", max_steps=4, checkpoint_every=2, keep_checkpoints=2, log_every=2)
    _, trained = run_stages(config, STAGES[:3])["train"]
    checkpoints = ArtifactStore(root / "cache").work_dir("train", trained.manifest["work_key"]) / "checkpoints"
    assert CheckpointDir(checkpoints).steps() == [2, 4]
    return Workspace(root, config, tiny_model, checkpoints)


Setup = Callable[[Workspace, Path], AbstractContextManager[list[str]]]  # -> the arguments after `run`


def args(*extra: str) -> Setup:
    """The workspace's config with these arguments; `{tmp}` is the row's own folder."""
    @contextmanager
    def setup(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
        yield [str(ws.config), *(a.format(tmp=tmp) for a in extra)]
    return setup


def environment(name: str, value: str) -> Setup:
    """The workspace's config, run with `name=value` in the environment."""
    @contextmanager
    def setup(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(name, value)
            yield [str(ws.config)]
    return setup


@contextmanager
def missing_config(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
    yield [str(tmp / "nope.yaml")]


@contextmanager
def yaml_syntax_error(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
    (tmp / "bad.yaml").write_text("name: x\ntrain:\n  rank: 4\n   alpha: 4\n")
    yield [str(tmp / "bad.yaml")]


def model_copy(change: Callable[[Path], None]) -> Setup:
    """A copy of the tiny model, changed."""
    @contextmanager
    def setup(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
        shutil.copytree(ws.model, tmp / "model")
        change(tmp / "model")
        yield [str(ws.config), "--set", f"model.path={tmp / 'model'}"]
    return setup


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@contextmanager
def truncated_single_file(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
    (tmp / "model.safetensors").write_bytes((ws.model / "unet" / "diffusion_pytorch_model.safetensors").read_bytes())
    truncate(tmp / "model.safetensors")
    yield [str(ws.config), "--set", f"model.path={tmp / 'model.safetensors'}"]


@contextmanager
def a_transformer_file_alone(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
    """A ComfyUI `diffusion_models/` file (a Flux.1 transformer) given as the whole model."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.diffusion_model.double_blocks.0.img_attn.qkv.weight": torch.zeros(1)}, tmp / "flux.safetensors")
    yield [str(ws.config), "--set", f"model.path={tmp / 'flux.safetensors'}"]


def file_in_the_cache(rel: str, *extra: str) -> Setup:
    """A file where the shared cache keeps the folder `rel` (the folder is put back afterwards)."""
    @contextmanager
    def setup(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
        folder = ws.cache / rel
        shutil.move(folder, tmp / "moved-aside")
        folder.write_text("not a folder")
        try:
            yield [str(ws.config), *extra]
        finally:
            folder.unlink()
            shutil.move(tmp / "moved-aside", folder)
    return setup


def a_file_at(key: str) -> Setup:
    """A file where the config key `key` names a folder."""
    @contextmanager
    def setup(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
        (tmp / "file").write_text("not a folder")
        yield [str(ws.config), "--set", f"{key}={tmp / 'file'}"]
    return setup


def on_tmpfs(options: str) -> Setup:
    """cache_dir on a small tmpfs mounted for the row (needs the right to mount; else skipped)."""
    @contextmanager
    def setup(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
        with tmpfs(tmp / "mnt", options) as mount:
            yield [str(ws.config), "--set", f"cache_dir={mount / 'cache'}", "--set", f"output_dir={tmp / 'out'}"]
    return setup


@contextmanager
def unwritable_cache(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
    """A cache folder the user may not write (the run loses root's right to ignore that: see below)."""
    (tmp / "cache").mkdir(mode=0o555)
    try:
        yield [str(ws.config), "--set", f"cache_dir={tmp / 'cache'}"]
    finally:
        (tmp / "cache").chmod(0o755)


@contextmanager
def no_images(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
    (tmp / "empty").mkdir()
    yield [str(ws.config), "--set", f"data.path={tmp / 'empty'}"]


@contextmanager
def an_image_without_caption(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
    shutil.copytree(ws.root / "data", tmp / "data")
    (tmp / "data" / "rocket.txt").unlink()
    yield [str(ws.config), "--set", f"data.path={tmp / 'data'}"]


@contextmanager
def a_prior_dataset_without_images(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
    (tmp / "empty").mkdir()
    yield [str(ws.config), "--set", "data.path=null", "--set",
           f"data.datasets=[{{path: {ws.root / 'data'}}}, {{path: {tmp / 'empty'}, role: prior}}]"]


@contextmanager
def a_malformed_metadata_row_with_strict(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
    shutil.copytree(ws.root / "data", tmp / "data")
    (tmp / "data" / "metadata.jsonl").write_text('{"file_name": "rocket.jpg", "text": "a rocket"}\n{"file_name": \n')
    yield [str(ws.config), "--set", f"data.path={tmp / 'data'}", "--strict"]


@contextmanager
def edit_pairs_with_more_references_than_the_model_reads(ws: Workspace, tmp: Path) -> Iterator[list[str]]:
    """Every target of a pairs dataset names two references; the tiny Flux.1 Kontext reads one."""
    from lorapipe.stages.families import build_tiny_model

    shutil.copytree(ws.root / "data", tmp / "data")
    photos = sorted(p.name for p in (tmp / "data").glob("*.jpg"))
    (tmp / "data" / "refs").mkdir()
    for name in ("one.png", "two.png"):
        shutil.copy(tmp / "data" / photos[0], tmp / "data" / "refs" / name.replace(".png", ".jpg"))
    rows = [{"file_name": p, "reference": ["refs/one.jpg", "refs/two.jpg"]} for p in photos]
    (tmp / "data" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = build_tiny_model(tmp / "kontext", "flux1-kontext")
    yield [str(ws.config), "--set", f"model.path={model}", "--set", "data.path=null", "--set",
           f"data.datasets=[{{path: {tmp / 'data'}, reference_columns: [reference]}}]"]


@dataclass(frozen=True)
class Row:
    name: str
    setup: Setup
    expect: tuple[str, ...]  # what the last line of stderr says (`{tmp}`: the row's folder)
    code: int = 1
    in_flow: bool = False  # fails in a Prefect task (else before Prefect starts)
    plain_user: bool = False  # run without root's right to override file permissions


ROWS = [
    # the config and the command line
    Row("missing config", missing_config, ("nope.yaml", "cannot read config"), 2),
    Row("YAML syntax error", yaml_syntax_error, ("bad.yaml", "line 4, column 9", "not valid YAML"), 2),
    Row("unknown key", args("--set", "train.rnak=4"), ("train.rnak", "Extra inputs are not permitted"), 2),
    Row("bad value", args("--set", "train.learning_rate=-1"), ("train.learning_rate", "greater than 0"), 2),
    Row("rule across keys", args("--set", "train.warmup_steps=5", "--set", "train.lr_scheduler=constant"),
        ("train", "warmup_steps", "constant_with_warmup"), 2),
    Row("bad --set", args("--set", "train.rank"), ("--set expects key=value", "train.rank"), 2),
    Row("prior weight not positive", args("--set", "train.prior_loss_weight=0"),
        ("train.prior_loss_weight", "greater than 0"), 2),
    Row("--set into a value", args("--set", "name.x=1"), ("--set name.x", "name is not a section"), 2),
    Row("caption_variants unbounded", args("--set", "encode.caption_variants=100000000", "--set",
                                           "encode.shuffle_tags=true"),
        ("encode.caption_variants", "less than or equal to 64"), 2),
    Row("only prior datasets", args("--set", "data.path=null", "--set", "data.datasets=[{{path: {tmp}, role: prior}}]"),
        ("data.datasets", "every dataset has role: prior", "nothing to learn"), 2),
    Row("cache_dir of another protocol", args("--set", "cache_dir=gs://bucket/prefix"),
        ("cache_dir", "gs://bucket/prefix: only s3:// URLs"), 2),
    Row("credentials in cache_dir", args("--set", "cache_dir=s3://AKIAEXAMPLE:hunter2@bucket/prefix"),
        ("cache_dir", "credentials in a URL"), 2),
    Row("cpu_threads not positive", args("--set", "cpu_threads=0"), ("cpu_threads", "greater than 0"), 2),
    Row("OMP_NUM_THREADS not a number", environment("OMP_NUM_THREADS", "many"),
        ("OMP_NUM_THREADS='many' in the environment is not a number of threads", "cpu_threads")),
    Row("unknown stage (--only)", args("--only", "trian"), ("unknown stage 'trian'", "preprocess, encode"),),
    Row("unknown stage (--force)", args("--force", "evaluat"), ("unknown stage 'evaluat'",)),
    # the model
    Row("missing model folder", args("--set", "model.path={tmp}/none"), ("none/model_index.json not found",)),
    Row("unsupported pipeline", model_copy(lambda m: (m / "model_index.json").write_text(
        json.dumps({"_class_name": "KandinskyV22Pipeline"}))), ("model_index.json", "KandinskyV22Pipeline")),
    Row("model component missing", model_copy(lambda m: shutil.rmtree(m / "text_encoder")),
        ("names 'text_encoder' but there is no folder", "text_encoder")),
    Row("truncated UNet weights", model_copy(lambda m: truncate(m / "unet" / "diffusion_pytorch_model.safetensors")),
        ("unet/diffusion_pytorch_model.safetensors is truncated", "download it again")),
    Row("truncated VAE weights", model_copy(lambda m: truncate(m / "vae" / "diffusion_pytorch_model.safetensors")),
        ("vae/diffusion_pytorch_model.safetensors is truncated",)),
    Row("truncated single-file checkpoint", truncated_single_file, ("model.safetensors is truncated",)),
    Row("transformer file alone", a_transformer_file_alone,
        ("flux.safetensors is a Flux.1 transformer alone", "model.path to a Flux.1 base", "model.transformer:")),
    # the cache and output folders
    Row("cache_dir is a file", a_file_at("cache_dir"),
        ("file is a file where the cache keeps a folder", "cache_dir")),
    Row("file where the lock folder is", file_in_the_cache("locks"),
        ("cache/locks is a file where the cache keeps a folder",)),
    Row("output_dir is a file", a_file_at("output_dir"),
        ("output_dir", "file is a file where a folder is expected")),
    Row("read-only cache filesystem", on_tmpfs("ro,size=64k"), ("cache_dir", "read-only")),
    Row("cache folder not writable", unwritable_cache, ("cache_dir", "permission denied"), plain_user=True),
    # found while the stages run
    Row("no usable image", no_images, ("no usable image in", "empty"), in_flow=True),
    Row("prior dataset without a usable image", a_prior_dataset_without_images,
        ("no usable image in dataset 'empty' (role: prior)", "data.datasets"), in_flow=True),
    Row("image without a caption", an_image_without_caption,
        ("rocket.jpg: no caption (looked for rocket.txt, rocket.caption and a row naming it", "missing_caption"),
        in_flow=True),
    Row("edit pairs with more references than the model reads", edit_pairs_with_more_references_than_the_model_reads,
        ("no usable image in", "too_many_references"), in_flow=True),
    Row("malformed metadata row with --strict", a_malformed_metadata_row_with_strict,
        ("metadata.jsonl", "on_bad_row is error"), in_flow=True),
    Row("base_output target with a PiSSA start", args("--set", "train.prior_target=base_output", "--set",
                                                      "train.init=pissa"),
        ("train.prior_target: base_output needs the adapter switched off to leave the base",), 2),
    Row("prior setting without prior data", args("--set", "train.prior_target=base_output"),
        ("train.prior_target: no training image comes from a dataset with role: prior",), in_flow=True),
    Row("target module that is not a layer", args("--set", "train.target_modules=[to_out]"),
        ("train.target_modules: to_out: ", "is a ModuleList", "such as to_out.0"), in_flow=True),
    Row("earlier stage not cached", args("--only", "evaluate", "--set", "train.learning_rate=0.004"),
        ("train is not selected to run and has no cached artifact", "--only"), in_flow=True),
    Row("file where a stage's lock folder is", file_in_the_cache("locks/train", "--set", "train.learning_rate=0.003"),
        ("cache/locks/train is a file where a folder is expected",), in_flow=True),
    Row("disk full", on_tmpfs("size=128k"), ("mnt/cache: the disk is full", "cache gc"), in_flow=True),
]


def lorapipe(ws: Workspace, argv: list[str], plain_user: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_HOME": str(ws.root / "prefect-home")}
    demote = plain_user and os.geteuid() == 0
    return subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, preexec_fn=as_a_plain_user() if demote else None)


def assert_nothing_cached_was_lost(ws: Workspace) -> None:
    store = ArtifactStore(ws.cache)
    artifacts = list(store.artifacts())
    assert sorted(a.stage for a in artifacts) == ["encode", "preprocess", "train"]
    assert all(store.verify(a) == [] for a in artifacts)
    checkpoints = CheckpointDir(ws.checkpoints)
    assert checkpoints.steps() == [2, 4] and all(checkpoints.damage(s) == "" for s in (2, 4))


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_a_bad_input_ends_the_run_with_one_line(ws, tmp_path, row):
    with row.setup(ws, tmp_path) as argv:
        done = lorapipe(ws, ["run", *argv], row.plain_user)
    lines = done.stderr.splitlines()
    assert done.returncode == row.code, done.stderr[-3000:]
    last = lines[-1]
    assert last.startswith("lorapipe: error: "), done.stderr[-3000:]
    for fragment in row.expect:
        assert fragment.format(tmp=tmp_path) in last, last
    assert "Traceback" not in done.stderr and done.stderr.count(last.removeprefix("lorapipe: error: ")) == 1
    if row.in_flow:
        assert "Beginning flow run" in done.stderr and len(lines) <= MAX_FLOW_LINES, done.stderr
        log = Path(lines[-2].removeprefix("lorapipe: the full log of this run: "))
        assert "Traceback" in log.read_text()
    else:
        assert len(lines) == 1, done.stderr  # before Prefect starts
    assert_nothing_cached_was_lost(ws)


def test_debug_shows_the_traceback_and_still_ends_with_the_line(ws, tmp_path):
    with model_copy(lambda m: truncate(m / "vae" / "diffusion_pytorch_model.safetensors"))(ws, tmp_path) as argv:
        done = lorapipe(ws, ["run", *argv, "--debug"], plain_user=False)
    assert done.returncode == 1 and "Traceback (most recent call last)" in done.stderr
    assert "vae/diffusion_pytorch_model.safetensors is truncated" in done.stderr.splitlines()[-1]


def test_json_prints_one_document_with_the_error_and_the_stages_that_ran(ws, tmp_path):
    with args("--set", "train.target_modules=[to_out]")(ws, tmp_path) as argv:
        done = lorapipe(ws, ["run", *argv, "--json"], plain_user=False)
    document = json.loads(done.stdout)
    assert done.returncode == document["exit_code"] == 1
    assert f"lorapipe: {document['error']}" == done.stderr.splitlines()[-1]
    assert [(row["stage"], row["status"]) for row in document["stages"]] == [
        ("preprocess", "hit"), ("encode", "hit"), ("train", "failed")]
    assert document["pipeline"] == "bad" and "Traceback" in Path(document["log"]).read_text()


@pytest.mark.parametrize("argv", [["run", "{config}", "--set", "train.rank=0"], ["sweep", "{config}", "--grid", "train.rank"],
                                  ["status", "{config}", "--set", "train.rank=0"], ["cache", "ls", "--config", "{tmp}/no.yaml"],
                                  ["captions", "export", "{config}"],
                                  ["demo", "--arch", "sd15", "--arch", "flux1", "--workdir", "{tmp}/demos"]],
                         ids=lambda argv: argv[0])
def test_json_prints_the_error_of_a_command_that_fails_before_it_runs(ws, tmp_path, argv):
    done = lorapipe(ws, [a.format(config=ws.config, tmp=tmp_path) for a in argv] + ["--json"], plain_user=False)
    document = json.loads(done.stdout)
    assert done.returncode == document["exit_code"] != 0
    assert f"lorapipe: {document['error']}" == done.stderr.splitlines()[-1] and document["stages"] == []


@contextmanager
def folders_read_only(root: Path) -> Iterator[None]:
    """`root` and every folder in it without write permission, as on a share mounted read-only
    (files cannot be made, renamed or removed in them); their modes are put back afterwards."""
    modes = {folder: folder.stat().st_mode for folder in [root, *root.rglob("*")] if folder.is_dir()}
    for folder in modes:
        folder.chmod(0o555)
    try:
        yield
    finally:
        for folder, mode in modes.items():
            folder.chmod(mode)


def test_status_and_cache_ls_read_a_cache_they_may_not_write_and_the_rest_refuse_it(ws):
    cache = ["--cache-dir", str(ws.cache)]
    with folders_read_only(ws.cache):
        status = lorapipe(ws, ["status", str(ws.config), "--json"], plain_user=True)
        listed = lorapipe(ws, ["cache", "ls", *cache], plain_user=True)
        refused = [lorapipe(ws, argv, plain_user=True) for argv in (["cache", "verify", *cache], ["cache", "gc", *cache])]
    assert status.returncode == 0, status.stderr[-3000:]
    assert [(row["stage"], row["status"]) for row in json.loads(status.stdout)["stages"]] == [
        ("preprocess", "hit"), ("encode", "hit"), ("train", "hit"), ("evaluate", "miss")]
    assert listed.returncode == 0 and listed.stdout.count("\n") == 4, listed.stderr[-3000:]  # a header, 3 artifacts
    for done in refused:  # verify removes the shards it finds damaged, gc what is unused
        assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith(f"lorapipe: error: cache_dir {ws.cache} cannot be used") and \
            "permission denied" in done.stderr, done.stderr
    assert_nothing_cached_was_lost(ws)
