"""The Hugging Face Hub as gptkit meets it: is offline mode on, and does the hub answer at all?

`data=hub` (datasets) and `import hf=<owner/name>` / `train init_from=hf:<owner/name>` (models) ask both
questions before they call `datasets` or `huggingface_hub`, so that no network fails in seconds, with one
line, instead of after minutes of retries.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse
from urllib.request import getproxies

from gptkit.errors import GptkitError

# the connectivity check's wait when no config sets one (data=hub has data.timeout_s)
TIMEOUT_S = 5.0


def offline(*also: str) -> bool:
    """HF_HUB_OFFLINE (or one of the variables in `also`, e.g. HF_DATASETS_OFFLINE) is set to a true value."""
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", *also))


def check_hub_reachable(timeout: float, instead: str = "") -> None:
    """A TCP connect to the hub endpoint with a short timeout: no network fails in seconds, not minutes.
    The GptkitError names the endpoint and ends with `instead` (what to do without network)."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    u = urlparse(endpoint)
    proxy = getproxies().get(u.scheme)
    # behind a proxy the proxy is what must answer
    if proxy:
        endpoint = f"{endpoint} via proxy {proxy}"
        u = urlparse(proxy if "://" in proxy else f"http://{proxy}")
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=timeout).close()
    except OSError as exc:
        also = f"; {instead}" if instead else ""
        raise GptkitError(
            f"the Hugging Face Hub ({endpoint}) is unreachable ({exc.__class__.__name__}: {exc}){also}"
        ) from None
