"""`lorapipe run` as a user at a terminal meets it: what it says first, Ctrl-C during training
(SIGINT to the whole foreground process group, as a terminal sends it), and which library notes it shows."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LIBRARY_WARNINGS_SHOWN, LOADED_AT_EXIT, REPO


@pytest.mark.slow
def test_ctrl_c_in_training_is_one_line_exit_130_and_keeps_the_checkpoint(tmp_path, tiny_config):
    config_path = tiny_config(tmp_path, "interrupted", max_steps=100000, checkpoint_every=5, keep_checkpoints=2)
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    run = subprocess.Popen([sys.executable, "-m", "lorapipe.flows.cli", "run", str(config_path)], cwd=REPO, env=env,
                           start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoints = tmp_path / "cache" / "work" / "train"
    deadline = time.time() + 600
    try:
        while max((int(p.name[5:]) for p in checkpoints.glob("*/checkpoints/step-*")), default=0) < 10:
            assert run.poll() is None, "the run ended before it could be interrupted"
            assert time.time() < deadline, "training never wrote its second checkpoint"
            time.sleep(0.2)
        os.killpg(run.pid, signal.SIGINT)
        stdout, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)

    assert run.returncode == 130, stderr
    assert "Traceback" not in stdout + stderr
    last = stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"lorapipe: training interrupted at step (\d+); run again to resume from its last"
                         r" checkpoint, (step-\d{6})", last)
    assert found, stderr[-2000:]
    kept = sorted(p.name for p in checkpoints.glob("*/checkpoints/step-*"))
    assert found[2] == kept[-1] and int(found[1]) >= int(found[2][5:]) >= 10
    assert "lorapipe: error" not in stderr and "the full log of this run" not in stderr
    # before anything else, the command says what it is about to do
    assert stderr.splitlines()[0].startswith("lorapipe: running pipeline 'interrupted'"), stderr[:500]


@pytest.mark.slow
def test_ctrl_c_before_training_says_what_was_kept(tmp_path, tiny_config):
    """Interrupted while Prefect starts (no stage's own message): the README's line, not a bare prefix."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    run = subprocess.Popen([sys.executable, "-m", "lorapipe.flows.cli", "run", str(tiny_config(tmp_path, "early"))], cwd=REPO,
                           env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in run.stderr:
            if line.startswith("lorapipe: running pipeline"):  # printed just before Prefect's start-up
                os.killpg(run.pid, signal.SIGINT)
                break
        stderr = run.communicate(timeout=120)[1]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == ("lorapipe: interrupted; run again to resume (finished stages stay"
                                               " cached)"), stderr[-2000:]
    assert "Traceback" not in stderr


# Ctrl-C (SIGINT) arriving while the command forks a worker: inside Python's at-fork handlers
CTRL_C_WHILE_FORKING = """
import os, signal, sys
from lorapipe.stages.processes.launching import start_worker
os.register_at_fork(before=lambda: os.kill(os.getpid(), signal.SIGINT))
try:
    start_worker([sys.executable, "-c", "pass"]).wait()
except KeyboardInterrupt:
    print("interrupted")
"""


def test_ctrl_c_while_a_worker_process_starts_stops_the_command():
    """A KeyboardInterrupt raised in an at-fork handler is dropped (and logging's lock, taken there,
    stayed taken: the command hung at its next log line); it must reach the command."""
    done = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_FORKING], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "interrupted", done.stderr[-2000:]


NOTES = """
import logging
from lorapipe.stages.processes.library_notes import quiet_harmless_notes
quiet_harmless_notes()
from transformers import CLIPImageProcessor  # without torchvision: a note that it falls back to PIL
peft = logging.getLogger("diffusers.loaders.peft")  # what diffusers says loading a denoiser-only LoRA into a pipeline
peft.warning("No LoRA keys associated to CLIPTextModel found with the prefix='text_encoder'. This is safe to ignore")
peft.warning("No LoRA keys associated to T5EncoderModel found with the prefix='text_encoder_2'. This is safe")
peft.warning("No LoRA keys associated to FluxTransformer2DModel found with the prefix='transformer'. a LoRA that loaded nothing")
logging.getLogger("transformers.processing_utils").warning(  # transformers' own, on loading a captioner's processor
    "`PaddleOCRVLProcessor` defines `image_processor_class = 'AutoImageProcessor'`, which is deprecated."
    " Register the correct mapping in `AutoImageProcessor` instead.")
import torch
from torch.nn.attention.flex_attention import flex_attention  # LTX-2.5's diffusion decoder, on a CPU: unfused
flex_attention(*[torch.zeros(1, 1, 8, 8)] * 3)
"""


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision's note needs it absent")
def test_harmless_library_notes_are_dropped_and_other_warnings_shown():
    shown = subprocess.run([sys.executable, "-c", NOTES], cwd=REPO, env={**os.environ, **LIBRARY_WARNINGS_SHOWN},
                           capture_output=True, text=True, check=True).stderr
    assert "torchvision" not in shown and "text_encoder" not in shown and "PaddleOCRVLProcessor" not in shown
    assert "flex_attention" not in shown
    assert "a LoRA that loaded nothing" in shown  # the denoiser's: that one matters


def test_training_starts_ahead_only_when_the_run_will_train(tmp_path, tiny_config, run_stages):
    from lorapipe.flows.config import load_config
    from lorapipe.flows.run_plan import plan_run

    def building(config_path, only=(), force=(), overrides=()):
        return plan_run(load_config(config_path, list(overrides)), list(only), None, list(force), print).building()

    config_path = tiny_config(tmp_path, "ahead", max_steps=2, checkpoint_every=2)
    assert building(config_path) == {"preprocess", "encode", "train", "evaluate"}
    run_stages(config_path, ("preprocess", "encode", "train"))
    assert building(config_path) == {"evaluate"}  # no training process, no encode imports
    assert "train" in building(config_path, force=["train"])
    assert building(config_path, overrides=["train.learning_rate=0.5"]) == {"train", "evaluate"}
    assert not building(config_path, only=["encode"], overrides=["train.learning_rate=0.5"])


IMPORTED_AHEAD = """
import importlib, json, sys
from pathlib import Path
from lorapipe.stages.families import for_model
from lorapipe.stages.models import import_model_code
model, stage, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
import_model_code(model, for_model(model), stage)
index, ahead = json.loads((model / "model_index.json").read_text()), {}
for name in names:  # a class imported ahead loads no module when it is first used
    before = set(sys.modules)
    getattr(importlib.import_module(index[name][0]), index[name][1])
    ahead[name] = not set(sys.modules) - before
print(json.dumps(ahead))
"""


def test_the_model_code_a_stage_loads_can_be_imported_ahead(tiny_model):
    """What a run imports while Prefect's server starts when encode will build: the classes of the
    text encoder and the VAE (a stage that loads no model imports none of them)."""
    def imported_ahead(stage: str) -> dict[str, bool]:
        run = subprocess.run([sys.executable, "-c", IMPORTED_AHEAD, str(tiny_model), stage, "text_encoder", "vae"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(run.stdout.splitlines()[-1])

    assert imported_ahead("encode") == {"text_encoder": True, "vae": True}
    assert imported_ahead("preprocess") == {"text_encoder": False, "vae": False}


def test_a_profile_without_the_temporary_server_gets_prefects_own_answer(tmp_path, tiny_config):
    """With the temporary server not allowed (and no API named) the command says what Prefect says,
    rather than restarting the server it had just stopped until it gave up."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false"}
    env.pop("PREFECT_API_URL", None)
    run = subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", "run", str(tiny_config(tmp_path, "no-server"))],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1].startswith("lorapipe: error: No Prefect API URL provided"), run.stderr[-2000:]


def test_an_api_in_the_active_prefect_profile_means_no_temporary_server(tmp_path, monkeypatch):
    """`prefect config set PREFECT_API_URL=...` (a server kept running) is read without importing prefect,
    so the command does not start, and then stop, a temporary server of its own; PREFECT_PROFILE picks
    the profile as in Prefect."""
    from lorapipe.flows.server import EmbeddedServer, active_profile

    (tmp_path / "profiles.toml").write_text('active = "kept"\n\n[profiles.kept]\nPREFECT_API_URL = '
                                            '"http://127.0.0.1:4200/api"\n\n[profiles.ephemeral]\n')
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_PROFILE", raising=False)
    monkeypatch.delenv("PREFECT_PROFILES_PATH", raising=False)
    assert active_profile()["PREFECT_API_URL"] == "http://127.0.0.1:4200/api"
    assert EmbeddedServer.unless_configured() is None
    monkeypatch.setenv("PREFECT_PROFILE", "ephemeral")
    assert "PREFECT_API_URL" not in active_profile()
    (tmp_path / "profiles.toml").write_text("active = [unclosed")
    assert active_profile() == {}  # Prefect itself names a broken profiles file



@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="nf4 needs bitsandbytes installed")
def test_a_run_imports_torch_once_where_it_trains_and_the_command_hides_the_quantisation_libraries(tmp_path,
                                                                                                 tiny_config):
    """torch, transformers and diffusers take seconds to import on two cores (BENCHMARKS.md,
    start-up): a run that trains imports them in one process, started ahead, which encodes, trains
    (an nf4 base: with bitsandbytes) and evaluates; the command's own process (Prefect, the flow)
    imports none of them. diffusers imports bitsandbytes and torchao whenever they are installed:
    the command's own process hides both where it encodes itself (no training, so no process
    started ahead), though the config is nf4."""
    config_path = tiny_config(tmp_path, "once", max_steps=2, checkpoint_every=2, base_quantization="nf4")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}

    def lorapipe_run(*args: str) -> str:
        run = subprocess.run([sys.executable, "-c", LOADED_AT_EXIT, "run", str(config_path), *args],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stderr

    stderr = lorapipe_run()
    assert stderr.splitlines()[-1] == "loaded: []", stderr[-3000:]
    for said in ("encode: in the process started ahead", "train: in the process started ahead",
                 "evaluate: in the process started ahead"):
        assert said in stderr, said
    stages = {s["stage"]: s for s in json.loads((tmp_path / "out" / "run-summary.json").read_text())["stages"]}
    assert [s["status"] for s in stages.values()] == ["computed"] * 4
    assert stages["encode"]["info"]["latents_encoded"] == 8 and stages["train"]["info"]["steps"] == 2
    assert (tmp_path / "out" / "grid.png").is_file() and json.loads((tmp_path / "out" / "metrics.json").read_text())
    trained = json.loads((Path(stages["train"]["path"]) / "train_config.json").read_text())
    assert trained["params"]["base_quantization"] == "nf4" and trained["steps"] == 2
    # new latents (another size), encoded by the command itself
    encoding = lorapipe_run("--only", "preprocess", "--only", "encode", "--set", "preprocess.resolution=128")
    assert encoding.splitlines()[-1] == "loaded: ['diffusers', 'torch', 'transformers']"


def test_outputs_of_an_artifact_removed_while_they_are_copied_are_refused(tmp_path):
    """`cache rm` or `gc` may remove an artifact between its lookup and the copy of its files into
    output_dir: that is said (a run served without a flow then runs the flow), never a run whose
    outputs are silently missing."""
    from lorapipe.flows.outputs import ArtifactRemoved, copy_outputs
    from lorapipe.flows.runner import StageResult

    artifact, out = tmp_path / "cache" / "train" / "k", tmp_path / "out"
    artifact.mkdir(parents=True)
    out.mkdir()
    (artifact / "pytorch_lora_weights.safetensors").write_bytes(b"lora")
    result = StageResult("train", "hit", "k", "digest", str(artifact), 0.0, "hit", files=str(artifact))
    copy_outputs(result, out)
    assert (out / "pytorch_lora_weights.safetensors").read_bytes() == b"lora"
    shutil.rmtree(artifact)
    with pytest.raises(ArtifactRemoved, match="train: its artifact .* was removed"):
        copy_outputs(result, out)
