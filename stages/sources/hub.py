"""A Hugging Face repo id as a base model: the diffusers folder of one commit, from the local
Hugging Face cache (HF_HUB_CACHE) or downloaded into it.

huggingface_hub's `snapshot_download` does the work: online it resolves the revision to a commit
and fetches what is missing; with HF_HUB_OFFLINE set, or the Hub unreachable, it falls back to the
cache (refs/<revision> names the commit; a commit is looked up in snapshots/ directly). Only what a
diffusers pipeline loads is fetched: safetensors weights, never .bin/.ckpt/.pt nor a repo's
top-level single-file checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorapipe.cache.errors import UserError

DEFAULT_REVISION = "main"
# *.jinja: a chat template as transformers writes it (a processor's or tokenizer's chat_template.jinja)
PIPELINE_FILES = ["model_index.json", "modular_model_index.json", "*/*.json", "*/*.safetensors", "*/*.txt",
                  "*/*.model", "*/*.tiktoken", "*/*.jinja"]


@dataclass(frozen=True)
class Snapshot:
    repo: str
    revision: str  # as configured: a branch, a tag or a commit
    commit: str
    folder: Path  # the snapshot in the Hugging Face cache (its files are links into blobs/)


def is_repo_id(text: str) -> bool:
    """Whether `text` is shaped like a Hugging Face repo id (`owner/name`), as huggingface_hub validates it."""
    if text.count("/") != 1:  # a model repo's id is always namespaced
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def snapshot(repo: str, revision: str | None, cached_only: bool = False) -> Snapshot:
    """The diffusers folder of `repo` at `revision` (default main); `cached_only`: never the network."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError, \
        RepositoryNotFoundError, RevisionNotFoundError

    revision = revision or DEFAULT_REVISION
    where = f"model.path: Hugging Face repo {repo}@{revision}"
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=PIPELINE_FILES,
                                        local_files_only=cached_only))
    except RevisionNotFoundError:
        raise UserError(f"{where}: the Hub has no revision {revision!r} (model.revision: a branch, tag or commit)"
                        ) from None
    except RepositoryNotFoundError:
        raise UserError(f"{where}: no such repo on the Hub, or it is private or gated and no token is set"
                        " (huggingface-cli login)") from None
    except IncompleteSnapshotError:
        raise UserError(f"{where} is only partly in the Hugging Face cache ({constants.HF_HUB_CACHE}): run again"
                        " with the Hub reachable (HF_HUB_OFFLINE unset) to complete it") from None
    except LocalEntryNotFoundError:
        offline = " and HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else " and the Hub cannot be reached"
        raise UserError(f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}){offline}; nor is"
                        f" {repo} a local path") from None
    except HfHubHTTPError as error:
        raise UserError(f"{where}: {str(error).splitlines()[0]}") from None
    return Snapshot(repo, revision, folder.name, folder)
