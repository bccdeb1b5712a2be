"""`gptkit export ... push_to_hub=owner/name`: what `gptkit export` wrote (a transformers folder, a PEFT
adapter folder, a GGUF file or any other folder or file), with its model card (gptkit/hf/card.py), uploaded
to a Hugging Face Hub model repository through huggingface_hub's HfApi: create_repo (private unless
private=false), then upload_folder (or upload_file for one file and its card).

The token is read from HF_TOKEN (or HUGGING_FACE_HUB_TOKEN) and handed to HfApi only: it is never printed,
logged, or written into the export. Everything that can be known without uploading (the repository id, the
token, HF_HUB_OFFLINE, whether the hub answers) is checked by `check` before the export writes anything: one
line and exit status 2.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from gptkit import hub
from gptkit.errors import ConfigError, GptkitError

TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
REPO_ID = re.compile(r"[\w-][\w.-]*/[\w-][\w.-]*")
CARD = "README.md"


@dataclass
class Push:
    """A checked push: the repository, its visibility and the token (never shown: repr leaves it out)."""

    repo_id: str
    private: bool
    token: str

    def __repr__(self) -> str:
        return f"Push(repo_id={self.repo_id!r}, private={self.private})"

    @property
    def url(self) -> str:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        return f"{endpoint}/{self.repo_id}"

    def hidden(self, text: str) -> str:
        """`text` with the token, wherever it appears, replaced (an error message may quote a header)."""
        return text.replace(self.token, "<HF_TOKEN>") if self.token else text

    def upload(self, out: Path, card: str) -> list[str]:
        """Create the repository (exist_ok) and upload `out` with its card; the files uploaded, in the
        repository's names. A folder gets its card as README.md beside its files; one file gets it uploaded as
        README.md. Every failure: one line, the token never in it."""
        from huggingface_hub import HfApi

        api = HfApi(token=self.token)
        message = f"gptkit export: {out.name}"
        try:
            api.create_repo(self.repo_id, repo_type="model", private=self.private, exist_ok=True)
            if out.is_dir():
                (out / CARD).write_text(card, encoding="utf-8")
                api.upload_folder(
                    repo_id=self.repo_id, repo_type="model", folder_path=str(out), commit_message=message
                )
                return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
            api.upload_file(
                path_or_fileobj=str(out),
                path_in_repo=out.name,
                repo_id=self.repo_id,
                repo_type="model",
                commit_message=message,
            )
            api.upload_file(
                path_or_fileobj=card.encode("utf-8"),
                path_in_repo=CARD,
                repo_id=self.repo_id,
                repo_type="model",
                commit_message=f"{message}: model card",
            )
            return sorted([out.name, CARD])
        except Exception as exc:  # noqa: BLE001 - the hub or the network failed: one line, the export kept
            said = self.hidden((str(exc).splitlines() or [""])[0][:200])
            raise GptkitError(
                f"push_to_hub={self.repo_id}: the upload failed ({type(exc).__name__}: {said}); the export "
                f"is complete in {out}: check the token's write access and the network, and export "
                "again with force=true"
            ) from None


def token() -> str | None:
    """The token of the first of TOKEN_VARS that is set (not empty)."""
    for var in TOKEN_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            return value
    return None


def check(repo_id: object, private: object) -> Push:
    """push_to_hub=<owner/name> checked before anything is written: the id, a token, not offline, the hub
    answering (a connect with a short timeout). One-line ConfigError/GptkitError otherwise."""
    spec = str(repo_id)
    if not REPO_ID.fullmatch(spec):
        raise ConfigError(f"push_to_hub={spec!r} is not a Hub repository id; write push_to_hub=owner/name")
    if not isinstance(private, bool):
        raise ConfigError(f"private={private!r} must be true or false")
    secret = token()
    if secret is None:
        raise ConfigError(
            f"push_to_hub={spec} needs a Hugging Face token with write access in HF_TOKEN (or "
            "HUGGING_FACE_HUB_TOKEN); nothing was exported"
        )
    if hub.offline():
        raise GptkitError(f"push_to_hub={spec}: HF_HUB_OFFLINE=1 forbids uploading; nothing was exported")
    hub.check_hub_reachable(hub.TIMEOUT_S, "nothing was exported; export without push_to_hub")
    return Push(spec, private, secret)
