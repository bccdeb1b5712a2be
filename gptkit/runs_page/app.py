"""`gptkit runs serve`: the page of the runs under a folder, on the HTTP stack `gptkit serve` uses
(gptkit/serve/http.py: the socket, uvicorn with a deadline on each request head, the Host guard).

    GET /                     the page (page.html): the table, the selected runs' curves overlaid, their
                              configs side by side (differences marked), a run's plan, manifest and samples
    GET /api/runs             every run's row (scan.py), read again at each call: the page polls it, and a
                              metrics.csv or config.yaml not changed since the last call is not read again
    GET /api/series?run=N     run N's curves (series.py)
    GET /api/config?run=N     run N's config.yaml, flattened to dotted keys
    GET /api/files?run=N      run N's plan.json, manifest.json and the last samples of samples.jsonl

A run is named as the table names it; a name that is not one of the folder's runs is a 404 (no path is
ever taken from a request). Errors are JSON ({"error": {"message": ...}}), never a traceback.
"""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from gptkit.errors import GptkitError
from gptkit.runs import CONFIG_FILE, MANIFEST_FILE, METRICS_FILE, PLAN_FILE
from gptkit.runs_page.scan import Damaged, find_runs, read_run_config, run_name, scan
from gptkit.runs_page.series import read_series
from gptkit.serve.http import HostGuard, error_body

PAGE_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SAMPLES_FILE = "samples.jsonl"
# what /api/files returns of a file at most: the head of manifest.json and plan.json, the tail of samples
FILE_BYTES = 256 * 1024
SAMPLES = 20


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, code), status_code=status)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def _head(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            data = f.read(FILE_BYTES + 1)
    except OSError:
        return None
    text = data[:FILE_BYTES].decode("utf-8", "replace")
    return text + ("\n... (cut at 256 KiB)" if len(data) > FILE_BYTES else "")


def _tail_lines(path: Path, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - FILE_BYTES))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    if size > FILE_BYTES:
        lines = lines[1:]
    return lines[-n:]


class RunsPage:
    """The handlers over one folder of runs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # scan.py's memo of unchanged files, kept between polls (one entry per run)
        self.cache: dict = {}
        self.page = resources.files("gptkit.runs_page").joinpath("page.html").read_text(encoding="utf-8")

    def run_dir(self, request: Request) -> Path:
        name = request.query_params.get("run")
        if not name:
            raise HTTPException(400, "give the run: ?run=<name as the table shows it>")
        try:
            runs = {run_name(p, self.root): p for p in find_runs(self.root)}
        except GptkitError as exc:
            raise HTTPException(404, str(exc)) from None
        if name not in runs:
            raise HTTPException(404, f"no run {name[:200]!r} under {self.root}")
        return runs[name]

    def index(self, request: Request) -> Response:
        return HTMLResponse(
            self.page, headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-cache"}
        )

    def runs(self, request: Request) -> Response:
        try:
            rows = scan(self.root, self.cache)
        except GptkitError as exc:
            return JSONResponse({"root": str(self.root), "runs": [], "problem": str(exc)})
        return JSONResponse({"root": str(self.root), "runs": [r.as_json() for r in rows]})

    def series(self, request: Request) -> Response:
        run = self.run_dir(request)
        if not (run / METRICS_FILE).is_file():
            return JSONResponse({"run": request.query_params["run"], "curves": {}})
        try:
            curves = read_series(run / METRICS_FILE)
        except Damaged as exc:
            return _error(422, f"{run}: {exc}", "damaged")
        return JSONResponse({"run": request.query_params["run"], "curves": curves})

    def config(self, request: Request) -> Response:
        run = self.run_dir(request)
        if not (run / CONFIG_FILE).is_file():
            return JSONResponse({"run": request.query_params["run"], "config": {}})
        try:
            cfg = read_run_config(run)
        except Damaged as exc:
            return _error(422, f"{run}: {exc}", "damaged")
        flat = {k: json.dumps(v) if not isinstance(v, str) else v for k, v in flatten(cfg).items()}
        return JSONResponse({"run": request.query_params["run"], "config": flat})

    def files(self, request: Request) -> Response:
        run = self.run_dir(request)
        return JSONResponse(
            {
                "run": request.query_params["run"],
                "plan": _head(run / PLAN_FILE),
                "manifest": _head(run / MANIFEST_FILE),
                "samples": _tail_lines(run / SAMPLES_FILE, SAMPLES),
            }
        )

    def routes(self) -> list[Route]:
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/api/runs", self.runs, methods=["GET"]),
            Route("/api/series", self.series, methods=["GET"]),
            Route("/api/config", self.config, methods=["GET"]),
            Route("/api/files", self.files, methods=["GET"]),
        ]


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404 and not str(exc.detail).startswith("no run"):
        return _error(404, f"Unknown request URL: {request.method} {request.url.path}", "not_found")
    if exc.status_code == 405:
        return _error(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")
    return _error(exc.status_code, str(exc.detail), "bad_request" if exc.status_code == 400 else "not_found")


async def _internal(request: Request, exc: Exception) -> Response:
    line = " ".join(str(exc).split())[:300] or type(exc).__name__
    print(f"error: {request.method} {request.url.path} failed ({line})", file=sys.stderr, flush=True)
    return _error(500, f"internal error ({line})", "internal_error")


def build_app(root: Path | str, allowed_hosts: tuple[str, ...] = (), any_ip_host: bool = False) -> Starlette:
    """The page's app over the runs under root."""
    page = RunsPage(Path(root))
    return Starlette(
        routes=page.routes(),
        exception_handlers={HTTPException: _http_error, Exception: _internal},
        middleware=[Middleware(HostGuard, allowed=tuple(allowed_hosts), any_ip=any_ip_host)],
    )


def serve_runs(
    root: Path | str,
    host: str = "127.0.0.1",
    port: int = 8001,
    access_log: bool = False,
    allowed_hosts: tuple[str, ...] = (),
) -> int:
    """Serve the page until Ctrl-C or SIGTERM (find_runs' one-line errors first: a folder with no runs)."""
    import uvicorn

    from gptkit.serve.http import bind, head_timeout_protocol, is_loopback, is_wildcard, log_config

    root = Path(root)
    count = len(find_runs(root))
    sock = bind(host, port)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound}"
    wildcard = is_wildcard(host)
    app = build_app(
        root, allowed_hosts=tuple(allowed_hosts) + (() if wildcard else (host,)), any_ip_host=wildcard
    )
    config = uvicorn.Config(
        app,
        http=head_timeout_protocol(30.0),
        log_config=log_config(),
        log_level="info" if access_log else "warning",
        access_log=access_log,
        lifespan="off",
        timeout_graceful_shutdown=3,
        server_header=False,
    )
    print(f"runs page: {count} run(s) under {root.resolve()}", flush=True)
    print(f"  listening on {url}  (Ctrl-C stops)", flush=True)
    if not is_loopback(host):
        print(
            f"warning: host={host} accepts connections from other machines: anyone who reaches this port "
            "can read the runs' configs and metrics",
            file=sys.stderr,
            flush=True,
        )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0
