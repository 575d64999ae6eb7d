"""encode.executor: dask on a local cluster of 2 worker processes: the same records, shards and
index as the local executor, and a worker killed mid-chunk costs a retry, never a duplicate."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from lorapipe.cache.samples import SampleStore
from lorapipe.stages import encode
from lorapipe.stages.encode.dask_executor import encode_chunk
from lorapipe.stages.processes.launching import environment_kept
from lorapipe.stages.processes.optional_libraries import OPTIONAL
from lorapipe.stages.encode.workers import EncodeJobs
from lorapipe.stages.processes.placement import DaskCluster
from lorapipe.stages.preprocess.rows import read_rows

from test_encode import encode_inputs, prepare, run_encode

# 17 records (8 latents, 9 texts) -> 9 chunks, on one torch thread per process whichever executor
# encodes them (CPU kernels' float sums depend on the thread count)
CHUNKED = {"batch_size": 2, "shard_records": 2, "cpu_threads": 1}


def artifact_files(out: Path) -> dict[str, bytes]:
    """The encode artifact's data files (what its digest covers), by path."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and not p.relative_to(out).as_posix().startswith("logs/")}


def stored_keys(cache_root: Path) -> list[str]:
    """Every record key in every committed shard of the sample store, duplicates kept."""
    return [key for meta in SampleStore(cache_root).dir.glob("*.json") for key in json.loads(meta.read_text())["records"]]


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory, demo_images, tiny_model):
    """The local executor's artifact files, counts and refs for the demo images, chunked as the tests chunk."""
    root = tmp_path_factory.mktemp("local")
    out, built, _ = run_encode(root, encode_inputs(root, prepare(root, demo_images), tiny_model), **CHUNKED)
    return artifact_files(out), built


@pytest.fixture(scope="module")
def cluster(s3_server):
    """Two worker processes, started after s3_server set the AWS_* variables they inherit."""
    from distributed import LocalCluster

    with environment_kept(), LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                          dashboard_address=":0") as c:
        yield c


def same_as_local(out: Path, built, reference) -> None:
    files, local = reference
    assert built.info["latents_encoded"] == local.info["latents_encoded"] == 8
    assert built.info["texts_encoded"] == local.info["texts_encoded"] == 9
    assert artifact_files(out) == files and built.refs == local.refs


@pytest.mark.slow
def test_a_local_dask_cluster_encodes_the_same_records_and_index_as_one_process(tmp_path, demo_images, tiny_model,
                                                                                local_reference):
    inputs = encode_inputs(tmp_path, prepare(tmp_path, demo_images), tiny_model)
    environment = dict(os.environ)
    out, built, logs = run_encode(tmp_path, inputs, executor="dask", dask_workers=2, **CHUNKED)
    assert dict(os.environ) == environment  # Dask's nanny left OMP_NUM_THREADS=1: training ran on one thread
    assert "encode: 9 chunks of up to 2 records on 2 Dask workers, 1 torch threads each" in logs
    same_as_local(out, built, local_reference)
    keys = stored_keys(inputs.cache_root)
    assert len(keys) == len(set(keys)) == 17


@pytest.mark.slow
def test_a_worker_killed_mid_chunk_has_its_chunk_redone_and_nothing_duplicated(tmp_path, demo_images, tiny_model,
                                                                               local_reference, cluster):
    from distributed import Client

    inputs = encode_inputs(tmp_path, prepare(tmp_path, demo_images), tiny_model)
    with Client(cluster) as client:
        killed, done = [], threading.Event()
        killer = threading.Thread(target=lambda: killed.append(kill_a_worker_mid_chunk(client, done)), daemon=True)
        killer.start()
        try:
            out, built, _ = run_encode(tmp_path, inputs, executor="dask", dask_address=cluster.scheduler_address,
                                       **CHUNKED)
        finally:
            done.set()
            killer.join()
    assert killed == [True], "no worker was caught in the middle of a chunk"
    same_as_local(out, built, local_reference)
    keys = stored_keys(inputs.cache_root)
    assert len(keys) == len(set(keys)) == 17


def kill_a_worker_mid_chunk(client, done: threading.Event) -> bool:
    """SIGKILL the process of the first worker seen executing an encode chunk; whether one was.
    A fresh worker's first chunk loads the encoders (seconds), so the kill lands mid-chunk."""
    while not done.is_set():
        busy = {addr: keys for addr, keys in client.processing().items()
                if any(str(k).startswith("encode-chunk-") for k in keys)}
        executing = client.run(lambda dask_worker: (os.getpid(), [str(ts.key) for ts in dask_worker.state.executing]),
                               workers=list(busy)) if busy else {}
        victim = next((pid for pid, keys in executing.values() if any(k.startswith("encode-chunk-") for k in keys)), None)
        if victim:
            os.kill(victim, signal.SIGKILL)
            return True
        time.sleep(0.02)
    return False


def test_a_retried_chunk_encodes_only_what_its_killed_attempt_did_not_commit(tmp_path, demo_images, tiny_model,
                                                                             count_encoder_rows):
    inputs = encode_inputs(tmp_path, prepare(tmp_path, demo_images), tiny_model)
    dataset = read_rows(inputs.preprocess_dir / "dataset.json")
    keys = encode.SampleKeys.of(dataset, encode.EncodeParams(), inputs.model_digests["vae"],
                                encode.text_ingredients(inputs.bound_family(), inputs.bound_family().text_settings(
                                    inputs.model_path, encode.EncodeParams()), inputs),
                                inputs.bound_family().geometry(inputs.model_path).downsampling)
    chunk = EncodeJobs.plan(dataset, keys, keys.latents(), inputs.datasets).chunks(4)[0]  # 4 latents, no text
    samples = {i: dataset[i] for _, i, _ in chunk.latents}
    options = encode.EncodeOptions(num_workers=0, batch_size=2, shard_records=4)
    with count_encoder_rows() as first:
        encode_chunk(chunk, samples, encode.EncodeParams(), inputs, options)
    with count_encoder_rows() as retried:
        result = encode_chunk(chunk, samples, encode.EncodeParams(), inputs, options)
    assert first == {"vae": 4, "text": 0} and retried == {"vae": 0, "text": 0}
    assert result.latents == 4 and result.failed == {}
    assert sorted(stored_keys(inputs.cache_root)) == sorted(chunk.keys())


@pytest.mark.slow
def test_dask_workers_encode_into_an_s3_cache_once_each(tmp_path, demo_images, tiny_model, s3_server,
                                                        local_reference, cluster):
    from lorapipe.cache.object_store import ObjectSettings, open_store

    store = open_store(s3_server.url("dask-encode"), ObjectSettings(tmp_path / "local-side", 1 << 30, 60.0))
    remote = store.sample_store()  # the local side now names the bucket: stages are given store.root
    inputs = encode_inputs(tmp_path, prepare(tmp_path, demo_images), tiny_model)
    inputs = encode.EncodeInputs(inputs.preprocess_dir, inputs.datasets, store.root, inputs.model_path,
                                 inputs.family, inputs.model_digests)
    out, built, _ = run_encode(tmp_path, inputs, executor="dask", dask_address=cluster.scheduler_address, **CHUNKED)
    same_as_local(out, built, local_reference)
    shards = remote.committed()  # read from the bucket
    keys = [key for meta in shards.values() for key in meta["records"]]
    assert len(keys) == len(set(keys)) == 17 and len(shards) == 9


@pytest.mark.slow
def test_the_stages_own_dask_workers_import_diffusers_without_the_quantisation_libraries():
    """A worker of the cluster encode starts for itself runs only encode's tasks, which never use
    bitsandbytes or torchao: it hides them from diffusers (stages/processes/optional_libraries.py)."""
    def loaded_by_diffusers() -> list[str]:  # in the worker: what loading an encoder imports
        from diffusers import AutoencoderKL  # noqa: F401

        return sorted(name for name in OPTIONAL if sys.modules.get(name))

    with DaskCluster(workers=1).client(lambda line: None) as client:
        assert list(client.run(loaded_by_diffusers).values()) == [[]]
