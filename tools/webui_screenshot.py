"""Run an NNI experiment end to end, time it, and photograph its web UI's trials table.

    python tools/webui_screenshot.py                       # search.yaml, a free port, pictures in runs/webui/
    python tools/webui_screenshot.py --config my.yaml --out /tmp/shots --window 1800x1200

What it does: ``nnictl create`` on a free port (the trials import the ``parnas`` this Python finds,
so run it from a checkout with ``PYTHONPATH=$PWD`` to try that checkout's code), then it waits for
every trial to end, printing each one's status as it changes. Headless Chromium photographs the
"Trials detail" page, scrolled down to its trials table as a user scrolls (:data:`TO_TABLE`), twice:
``trials-running.png`` once a running trial's first intermediate result has arrived (the "Default metric" column reads
"(LATEST)") and ``trials-done.png`` at the end, both with the columns the README tells a user to choose (the trial,
its status and default metric, the architecture and its latency ratio), at 1,280 x 800 pixels unless ``--window``
says otherwise; beside each, ``trials-running.json`` and ``trials-done.json`` hold what the picture shows of the
table, one mapping per trial's row from each column to its text, of the cells wholly in the window (:data:`ROWS`).
The experiment is stopped (``nnictl stop``) in every case, and the wall time from ``nnictl create`` to the last
trial's end is printed.

The web UI keeps its chosen columns in the browser's localStorage (``<experiment id>_columns``);
the script writes that entry through Chromium's DevTools protocol (the ``websockets`` package,
which NNI itself depends on) before each picture, as clicking "Add/Remove columns" would.
Pictures are written outside git's view (``runs/`` is ignored). Needs ``chromium`` on PATH
(Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from parnas.report.experiments import launch  # noqa: E402  (the checkout's own, as the trials import it)

# The columns the README has a user choose. The web UI orders columns as its rows hold them (trial fields, then
# parameters, then metrics) at about 180 px each, and scrolls the rest off the right edge: at 1,280 px five fit,
# so the trial's ID and duration make way for what the trial found.
COLUMNS = ["sequenceId", "status", "latestAccuracy", "metric/architecture", "metric/latency_ratio"]
ENDED = ("SUCCEEDED", "FAILED", "USER_CANCELED", "SYS_CANCELED", "EARLY_STOPPED")
# The trials table's rows as the page shows them (the web UI's table is Fluent UI's DetailsList, whose rows and cells
# carry these automation ids and each cell its column's key): per row, column key -> text, of the cells wholly inside
# the window, so a column scrolled off the right edge or a row below the bottom is not in it.
ROWS = """JSON.stringify(Array.from(document.querySelectorAll('[data-automationid="DetailsRow"]')).map(row =>
  Object.fromEntries(Array.from(row.querySelectorAll('[data-automationid="DetailsRowCell"]')).filter(cell => {
    const r = cell.getBoundingClientRect();
    return r.width > 0 && r.left >= 0 && r.top >= 0 && r.right <= window.innerWidth && r.bottom <= window.innerHeight;
  }).map(cell => [cell.getAttribute('data-automation-key'), cell.innerText.trim()]))))"""
# The page opens on a chart of the default metric, with the trials table below the fold of an 800-px window; a
# user scrolls down to the table's "Trial jobs" title, and so does the picture.
TO_TABLE = """(Array.from(document.querySelectorAll('*')).find(e => e.childElementCount === 0 &&
  e.textContent.trim() === 'Trial jobs') || document.querySelector('[data-automationid="DetailsList"]'))
  ?.scrollIntoView({block: 'start'})"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rest(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/nni/{path}", timeout=10) as r:
        return json.load(r)


class Browser:
    """Headless Chromium driven over its DevTools protocol: open a page, run a script, take a picture."""

    def __init__(self, width: int, height: int) -> None:
        exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
        if exe is None:
            raise SystemExit("webui_screenshot: chromium not found (Debian: apt-get install chromium)")
        self.profile = tempfile.mkdtemp(prefix="parnas-chromium-")
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        for _ in range(300):
            if port_file.is_file() and port_file.read_text().strip():
                break
            time.sleep(0.1)
        debug_port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{debug_port}/json/list", timeout=10) as r:
            self.ws_url = next(t["webSocketDebuggerUrl"] for t in json.load(r) if t["type"] == "page")
        self.width, self.height = width, height

    def shoot(self, url: str, out: Path, local_storage: dict[str, str] | None = None,
              settle: float = 8.0) -> list[dict[str, str]]:
        """Photograph ``url`` into ``out``, its table rows (:data:`ROWS`) into the .json beside it; returns the rows."""
        return asyncio.run(self._shoot(url, out, local_storage or {}, settle))

    async def _shoot(self, url: str, out: Path, local_storage: dict[str, str], settle: float) -> list[dict[str, str]]:
        import websockets

        async with websockets.connect(self.ws_url, max_size=None) as ws:
            ids = iter(range(1, 1 << 30))

            async def call(method: str, **params: Any) -> dict[str, Any]:
                n = next(ids)
                await ws.send(json.dumps({"id": n, "method": method, "params": params}))
                while True:
                    reply = json.loads(await ws.recv())
                    if reply.get("id") == n:
                        return reply.get("result", {})

            await call("Page.enable")
            await call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                       deviceScaleFactor=1, mobile=False)
            await call("Page.navigate", url=url)
            await asyncio.sleep(settle)
            if local_storage:
                for key, value in local_storage.items():
                    await call("Runtime.evaluate", expression=f"localStorage.setItem({json.dumps(key)}, "
                                                              f"{json.dumps(value)})")
                await call("Page.reload")
                await asyncio.sleep(settle)
            await call("Runtime.evaluate", expression=TO_TABLE)
            await asyncio.sleep(1.0)
            shot = await call("Page.captureScreenshot", format="png")
            rows = await call("Runtime.evaluate", expression=ROWS, returnByValue=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(base64.b64decode(shot["data"]))
        shown = json.loads(rows.get("result", {}).get("value") or "[]")
        out.with_suffix(".json").write_text(json.dumps(shown, indent=1) + "\n")
        return shown

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


def columns_entry(experiment: str) -> dict[str, str]:
    """The localStorage entry the web UI reads its trials table's columns from (as its column dialog writes it)."""
    day = 24 * 3600 * 1000
    value = {"value": json.dumps(COLUMNS), "time": int(time.time() * 1000), "expire": 30 * day,
             "isSelectall": False}
    return {f"{experiment}_columns": json.dumps(value)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "search.yaml"), help="NNI experiment config (search.yaml)")
    parser.add_argument("--port", type=int, default=0, help="web UI port (default: a free one)")
    parser.add_argument("--out", default=str(REPO / "runs" / "webui"), help="folder for the pictures (runs/webui)")
    parser.add_argument("--window", default="1280x800", help="page size in pixels, WIDTHxHEIGHT (1280x800)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the trials (1800)")
    args = parser.parse_args()
    width, height = (int(v) for v in args.window.split("x"))
    port, out = args.port or free_port(), Path(args.out)
    browser = Browser(width, height)
    start = time.time()
    experiment = launch(args.config, port)
    print(f"experiment {experiment} on port {port}", flush=True)
    url = f"http://127.0.0.1:{port}/detail"
    try:
        shot_running, seen, jobs = False, {}, []
        deadline = start + args.timeout
        while time.time() < deadline:
            info, jobs = rest(port, "experiment"), rest(port, "trial-jobs")
            for job in jobs:
                if seen.get(job["trialJobId"]) != job["status"]:
                    seen[job["trialJobId"]] = job["status"]
                    print(f"{time.time() - start:6.0f} s  trial {job['trialJobId']} {job['status']}", flush=True)
            running = {j["trialJobId"] for j in jobs if j["status"] == "RUNNING"}
            if not shot_running and running and running & {m["trialJobId"] for m in rest(port, "metric-data")}:
                browser.shoot(url, out / "trials-running.png", columns_entry(experiment))
                shot_running = True
                print(f"{time.time() - start:6.0f} s  wrote {out / 'trials-running.png'}", flush=True)
            if len(jobs) >= info["params"]["maxTrialNumber"] and all(j["status"] in ENDED for j in jobs):
                break
            status = rest(port, "check-status")
            if status.get("status") in ("ERROR", "STOPPED"):  # e.g. the tuner crashed: no trial will follow
                print(f"webui_screenshot: the experiment is {status['status']}: {status.get('errors') or ''}",
                      file=sys.stderr)
                break
            time.sleep(2)
        else:
            print(f"webui_screenshot: the trials did not end within {args.timeout:.0f} s", file=sys.stderr)
        ends = [j["endTime"] for j in jobs if j.get("endTime")]
        created = rest(port, "experiment")["startTime"]
        if ends:
            print(f"{len(jobs)} trials ({', '.join(sorted({j['status'] for j in jobs}))}) in "
                  f"{(max(ends) - created) / 1000:.0f} s from nnictl create to the last trial's end "
                  f"({time.time() - start:.0f} s with this script's start)", flush=True)
        rows = browser.shoot(url, out / "trials-done.png", columns_entry(experiment))
        print(f"wrote {out / 'trials-done.png'} and {out / 'trials-done.json'} ({len(rows)} rows)")
    finally:
        subprocess.run([str(Path(sys.executable).parent / "nnictl"), "stop", experiment], capture_output=True,
                       env=dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"))
        browser.close()
        print(f"stopped {experiment}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
