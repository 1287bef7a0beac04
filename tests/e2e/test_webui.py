"""The web UI end to end in headless Chromium (Debian's, driven by Playwright): fill the Train tab with the
demo config, preview its YAML (the same config as examples/demo.yaml), preview the data, launch a 20-step run,
watch the loss curve appear, open Chat on the result and see a reply stream in, export the checkpoint, and
stop a second run. Any console error in the page fails the test. Screenshots go to the test's temp folder."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from shardforge.config import load_config
from shardforge.webui import form
from tests.conftest import REPO

CHROMIUM = Path("/usr/bin/chromium")
playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (.ci/run installs it)")

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def webui(tmp_path):
    """`shardforge webui` on a free loopback port, its root a folder holding the demo's data."""
    root = tmp_path / "root"
    shutil.copytree(REPO / "examples" / "data", root / "examples" / "data")
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADIO_ANALYTICS_ENABLED": "False",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}  # fmt: skip
    log = (tmp_path / "webui.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "shardforge", "webui", "--port", str(port), "--root", str(root)],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise AssertionError((tmp_path / "webui.log").read_text()) from None
            time.sleep(0.5)
    yield url, root
    os.killpg(server.pid, 15)
    server.wait(30)


def _fill(page, key: str, value: str) -> None:
    """Type into the form field of a config key (its widget's id is cfg- and the key's words)."""
    field = "#" + form.BY_KEY[key].elem_id
    page.locator(f"{field} textarea, {field} input").first.fill(value)


def _text(page, selector: str) -> str:
    return page.locator(selector).inner_text()


def _wait_for_text(page, selector: str, text: str, timeout: float = 30_000) -> None:
    """Until the element's text includes `text` (what a status line says when its work is done)."""
    condition = f"document.querySelector({selector!r}).innerText.includes({text!r})"
    page.wait_for_function(condition, timeout=timeout)


def test_train_watch_chat_export_and_stop_in_the_browser(webui, tmp_path, monkeypatch):
    url, root = webui
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1600})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url, wait_until="load")
        page.wait_for_selector("#cfg-output-dir textarea", timeout=60_000)

        # ---- Train: the demo config, field by field
        demo = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
        _fill(page, "output_dir", "runs/demo")
        _fill(page, "model.preset", "demo")
        _fill(page, "model.tokenizer", "examples/data/tokenizer")
        _fill(page, "data.train", yaml.safe_dump(demo["data"]["train"]))
        _fill(page, "data.eval", yaml.safe_dump(demo["data"]["eval"]))
        for key in ("data.max_length", "train.steps", "train.micro_batch", "train.lr", "train.warmup",
                    "train.eval_every", "train.log_every"):  # fmt: skip
            section, name = key.split(".")
            _fill(page, key, str(demo[section][name]))
        _fill(page, "train.micro_batch", "0")  # the config's own message, under the field it is about
        page.click("#preview-yaml")
        _wait_for_text(page, "#train-status", "error")
        assert "greater than or equal to 1" in _text(page, "#cfg-train-micro-batch")
        _fill(page, "train.micro_batch", str(demo["train"]["micro_batch"]))
        page.click("#preview-yaml")
        page.wait_for_function("document.querySelector('#command-line textarea').value.length > 0")
        assert "error" not in _text(page, "#cfg-train-micro-batch")
        preview = _text(page, "#yaml-preview .cm-content")
        page.screenshot(path=str(shots / "1-train-yaml.png"), full_page=True)
        monkeypatch.chdir(
            REPO
        )  # the demo's relative paths resolve against the repository, as the UI's against its root
        assert load_config(None, base=yaml.safe_load(preview)) == load_config(
            str(REPO / "examples" / "demo.yaml")
        )
        command = page.locator("#command-line textarea").input_value()
        assert command == "shardforge train runs/demo/webui-config.yaml"

        page.click("#preview-data")
        page.wait_for_selector("#data-preview mark.sf-target", timeout=60_000)
        assert "Sort the letters alphabetically." in _text(page, "#data-preview")  # the file's first record

        # ---- Runs: 20 steps with a checkpoint, the loss curve while it runs
        _fill(page, "train.steps", "20")
        _fill(page, "train.log_every", "2")
        _fill(page, "train.eval_every", "10")
        _fill(page, "checkpoint.every", "20")
        page.get_by_role("tab", name="Runs").click()
        page.click("#launch")
        _wait_for_text(page, "#run-status", "finished", 300_000)
        page.wait_for_selector("#loss-plot canvas, #loss-plot svg", timeout=30_000)
        page.screenshot(path=str(shots / "2-runs.png"), full_page=True)
        log = page.locator("#run-log textarea").input_value()
        assert "done: 20 steps" in log
        assert (root / "runs" / "demo" / "final" / "config.json").is_file()
        assert _text(page, "#resolved-config .cm-content").startswith("output_dir: runs/demo")
        assert yaml.safe_load((root / "runs" / "demo" / "config.yaml").read_text())["train"]["steps"] == 20

        # ---- Chat on the result: the reply grows on the page as tokens arrive
        page.get_by_role("tab", name="Chat").click()
        page.locator("#chat-model textarea").fill("runs/demo/final")
        page.click("#chat-load")
        _wait_for_text(page, "#chat-status", "loaded", 120_000)
        page.evaluate("""() => { window.__sizes = [];
            new MutationObserver(() => {
                const bot = document.querySelectorAll('#chatbot .bot');
                if (bot.length) window.__sizes.push(bot[bot.length - 1].innerText.length);
            }).observe(document.querySelector('#chatbot'),
                       {subtree: true, childList: true, characterData: true});
        }""")
        page.locator("#chat-input textarea").fill("Uppercase the text.\nhello world")
        page.click("#chat-send")
        page.wait_for_function("document.querySelectorAll('#chatbot .bot').length > 0", timeout=60_000)
        page.wait_for_timeout(3000)
        sizes = page.evaluate("window.__sizes")
        page.screenshot(path=str(shots / "3-chat.png"), full_page=True)
        assert len({s for s in sizes if s > 0}) >= 2, f"the reply did not stream: {sizes}"

        # ---- Export the step-20 checkpoint as an HF folder
        page.get_by_role("tab", name="Export").click()
        page.locator("#export-source textarea").fill("runs/demo")
        page.locator("#export-to textarea").fill("exports/demo-hf")
        page.click("#export")
        _wait_for_text(page, "#export-result", "exported", 120_000)
        assert (root / "exports" / "demo-hf" / "config.json").is_file()

        # ---- Stop: a long run started and stopped
        page.get_by_role("tab", name="Train").click()
        _fill(page, "output_dir", "runs/long")
        _fill(page, "train.steps", "100000")
        page.get_by_role("tab", name="Runs").click()
        page.click("#launch")
        _wait_for_text(page, "#run-status", "running", 30_000)
        page.wait_for_function(
            "document.querySelector('#run-log textarea').value.includes('step=')", timeout=120_000
        )
        page.click("#stop")
        page.wait_for_function(
            "/stopped|ended/.test(document.querySelector('#run-status').innerText)", timeout=60_000
        )
        page.screenshot(path=str(shots / "4-stopped.png"), full_page=True)

        # ---- Load YAML: the first run's file back into the form
        page.get_by_role("tab", name="Train").click()
        page.locator("#load-path textarea").fill("runs/demo/webui-config.yaml")
        page.click("#load-yaml")
        _wait_for_text(page, "#train-status", "loaded")
        assert page.locator("#cfg-train-steps textarea").input_value() == "20"
        assert page.locator("#cfg-output-dir textarea").input_value() == "runs/demo"
        browser.close()
    assert not errors, f"console errors in the page: {errors}"
    assert len(list(shots.glob("*.png"))) == 4
