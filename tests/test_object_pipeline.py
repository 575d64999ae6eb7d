"""The tiny demo pipeline with its cache (and its images) on S3, through `lorapipe run` processes
against a real server (SeaweedFS): two runs started together on an empty root compute each stage
once between them, a later run on a fresh host is all hits (served without a Prefect flow, its
outputs fetched to that host), `cache verify` passes, and the credentials given in the config are
written nowhere: not in the objects, the local files, the logs, nor Prefect's database (which
holds the runs' parameters)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from lorapipe.cache.objects import ObjectRoot
from lorapipe.flows.steps import STAGES

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
SECRET_KEY, SECRET = f"AKIA{uuid.uuid4().hex[:16].upper()}", f"secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_config, s3_server):
    """A tiny config whose cache_dir and data are on S3, its credentials in storage_options."""
    root = tmp_path_factory.mktemp("s3-pipeline")
    config_path = tiny_config(root, "s3demo", max_steps=8, checkpoint_every=4, keep_checkpoints=2, log_every=4)
    data = s3_server.url(f"data-{uuid.uuid4().hex[:8]}")
    images = ObjectRoot(data)
    for path in sorted((root / "data").iterdir()):
        images.put(path.name, path.read_bytes())
    config = yaml.safe_load(config_path.read_text())
    config.update(cache_dir=s3_server.url(f"cache-{uuid.uuid4().hex[:8]}"), data={"path": data},
                  storage_options={"key": SECRET_KEY, "secret": SECRET}, object_store={"lease_seconds": 5})
    config_path.write_text(yaml.safe_dump(config))
    return root


def lorapipe_run(workspace: Path, host: str) -> subprocess.Popen:
    """`lorapipe run` as on a host of its own: its own Prefect home and local side of the cache.
    Its environment has no AWS credentials: they come from the config's storage_options."""
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env["PREFECT_HOME"] = str(workspace / host / "prefect-home")
    return subprocess.Popen([sys.executable, "-m", "lorapipe.flows.cli", "run", str(workspace / "config.yaml"), "--json",
                             "--set", f"object_store.local_dir={workspace / host / 'local'}",
                             "--set", f"output_dir={workspace / host / 'out'}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(run: subprocess.Popen) -> dict:
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    return {row["stage"]: row for row in json.loads(out)["stages"]}


def test_two_runs_at_once_compute_each_stage_once_and_a_later_run_is_all_hits(workspace):
    first, second = lorapipe_run(workspace, "host-a"), lorapipe_run(workspace, "host-b")
    runs = [finished(first), finished(second)]
    for stage in STAGES:
        assert sorted(run[stage]["status"] for run in runs) == ["computed", "hit"], stage
        assert runs[0][stage]["key"] == runs[1][stage]["key"]
        assert runs[0][stage]["path"].startswith("s3://")
    for host in ("host-a", "host-b"):
        assert (workspace / host / "out" / "pytorch_lora_weights.safetensors").is_file()
    again = finished(lorapipe_run(workspace, "host-c"))
    assert [again[s]["status"] for s in STAGES] == ["hit"] * 4
    assert [again[s]["prefect_state"] for s in STAGES] == [None] * 4  # all cached: served without a flow
    for name in ("pytorch_lora_weights.safetensors", "grid.png", "metrics.json"):  # fetched to this host
        assert (workspace / "host-c" / "out" / name).is_file(), name
    verify = subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", "cache", "verify", "--config",
                             str(workspace / "config.yaml")], cwd=REPO, capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_the_credentials_are_written_nowhere(workspace, s3_server):
    if not (workspace / "host-c").is_dir():
        pytest.skip("needs the runs of the test before")
    config = yaml.safe_load((workspace / "config.yaml").read_text())
    written = [p for p in workspace.rglob("*") if p.is_file() and p.name != "config.yaml"]
    databases = [p for p in written if ".db" in p.name]
    recorded = b"".join(p.read_bytes() for p in databases)  # Prefect's record of the runs' parameters
    assert config["cache_dir"].encode() in recorded and b'"key": "**********"' in recorded.replace(b'\\"', b'"')
    for path in written:
        data = path.read_bytes()
        assert SECRET.encode() not in data and SECRET_KEY.encode() not in data, path
    for url in (config["cache_dir"], config["data"]["path"]):
        objects = ObjectRoot(url)
        for rel, data in objects.get_many(objects.list("")).items():
            assert SECRET.encode() not in data and SECRET_KEY.encode() not in data, rel
