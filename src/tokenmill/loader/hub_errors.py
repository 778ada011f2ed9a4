"""huggingface_hub's errors said as what to do: a name the Hub does not know (404), a gated or private repo without
a token (401), a revision or file it lacks, offline with nothing cached, a Hub that cannot be reached."""

from pathlib import Path

from tokenmill.errors import ModelFileError
from tokenmill.loader.hub_reference import HubReference

# the names of the HTTP clients' (httpx, httpx2, requests) exceptions for a server that cannot be reached
_UNREACHABLE = {"ConnectError", "TimeoutException", "NetworkError", "ConnectionError", "Timeout", "ProxyError"}


def is_unreachable(exc: BaseException) -> bool:
    return any(cls.__name__ in _UNREACHABLE for cls in type(exc).__mro__)


def explain_hub_error(
    exc: BaseException, ref: HubReference, endpoint: str, cache_dir: Path, offline: bool
) -> ModelFileError | None:
    """A ModelFileError that says what went wrong with `ref` and what to do, or None for an error that is not
    the Hub's (let it through as it is)."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo = ref.repo_id
    status = getattr(getattr(exc, "response", None), "status_code", None)
    token_hint = "set HF_TOKEN to a token of an account that may read it (or run `hf auth login`)"
    if isinstance(exc, GatedRepoError):
        return ModelFileError(
            f"{repo} is a gated model ({status}): accept its conditions on {endpoint}/{repo} and {token_hint}"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return ModelFileError(
            f"no model {repo!r} on the Hub ({endpoint}, {status or 404}): check the name (ORG/NAME, as in the "
            f"model's address); if it is private, {token_hint}"
        )
    if isinstance(exc, RevisionNotFoundError):
        return ModelFileError(f"{repo} has no revision {ref.revision!r} (a branch, tag or commit of the repo)")
    if isinstance(exc, OfflineModeIsEnabled | LocalEntryNotFoundError) and offline:
        return ModelFileError(
            f"HF_HUB_OFFLINE is set and {ref} is not in the Hub cache ({cache_dir}): download it first with the "
            f"network on (`tokenmill pull {_pull_args(ref)}`)"
        )
    if isinstance(exc, EntryNotFoundError):
        return ModelFileError(f"{repo}: a file is missing from the repo: {exc}")
    if isinstance(exc, HfHubHTTPError) and status == 401:
        return ModelFileError(f"the Hub refused access to {repo} (401): {token_hint}")
    if isinstance(exc, HfHubHTTPError) and status == 403:
        return ModelFileError(f"the Hub refused access to {repo} (403): the token in HF_TOKEN may not read it")
    if is_unreachable(exc) or isinstance(exc, LocalEntryNotFoundError):
        return ModelFileError(
            f"cannot reach the Hub at {endpoint} and {ref} is not in its cache ({cache_dir}): check the network, "
            f"HF_ENDPOINT, or download it elsewhere into that cache ({type(exc).__name__}: {exc})"
        )
    if isinstance(exc, HfHubHTTPError):
        return ModelFileError(f"the Hub answered {status} for {repo}: {exc}")
    return None


def _pull_args(ref: HubReference) -> str:
    args = ref.repo_id + (f":{ref.tag}" if ref.tag else "")
    if ref.hf_file:
        args += f" --hf-file {ref.hf_file}"
    return args + (f" --revision {ref.revision}" if ref.revision else "")
