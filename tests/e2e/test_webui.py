"""The web UI end to end in headless Chromium (Debian's, driven by Playwright), as a new user would use it.
From a root holding only the demo data: pick the demo preset (its YAML is examples/demo.yaml), the model and
a data set from the pickers, see the stage decide the sections shown, preview the data (with its length
histogram), plan (the chart and its figures), launch a 20-step run and watch its curves, evaluate it, chat
with it (the reply streams), export it, stop a second run and overlay both runs' curves. A second path: an
LLaMA-Factory user's data folder (LF's own dataset_info.json, identity and alpaca demo data) picked by entry
name. Every control has a label and is reachable by keyboard; any console error fails; screenshots of each
tab are kept in the test's output (tmp folder)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from playwright.sync_api import sync_playwright

from shardforge.config import load_config
from shardforge.webui import form
from tests.conftest import REPO, unavailable

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(autouse=True)
def _chromium():
    if not CHROMIUM.exists():
        unavailable("needs Debian's chromium (.ci/run installs it)")


FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path: Path, root: Path):
    """`shardforge webui` on a free loopback port over `root`."""
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
    return url, server


@pytest.fixture
def webui(tmp_path):
    """The web UI over a root holding the demo's data and nothing else."""
    root = tmp_path / "root"
    shutil.copytree(REPO / "examples" / "data", root / "examples" / "data")
    url, server = _serve(tmp_path, root)
    yield url, root
    os.killpg(server.pid, 15)
    server.wait(30)


def _field(page, key: str):
    """The form field of a config key (its widget's id is cfg- and the key's words)."""
    field = "#" + form.BY_KEY[key].elem_id
    return page.locator(f"{field} textarea, {field} input").first


def _fill(page, key: str, value: str) -> None:
    _field(page, key).fill(value)


def _text(page, selector: str) -> str:
    return page.locator(selector).inner_text()


def _wait_for_text(page, selector: str, text: str, timeout: float = 30_000) -> None:
    """Until the element's text includes `text` (what a status line says when its work is done)."""
    condition = f"document.querySelector({selector!r}).innerText.includes({text!r})"
    page.wait_for_function(condition, timeout=timeout)


def _choose(page, elem_id: str, option: str) -> None:
    """Pick an option of a dropdown: open it, type, click the option, leave it."""
    box = page.locator(f"#{elem_id} input").first
    box.click()
    box.fill(option)
    page.get_by_role("option", name=option, exact=True).click()
    box.blur()


def _value(page, key: str) -> str:
    return _field(page, key).input_value()


# Every visible control's accessible name (its label, aria-label or text) and whether a keyboard reaches it.
UNLABELLED = """() => [...document.querySelectorAll('input, textarea, select, button, [role=tab]')]
    .filter(e => e.offsetParent !== null && e.type !== 'hidden' && e.type !== 'file'
                 && !e.closest('[aria-hidden=true]'))
    .filter(e => !(e.getAttribute('aria-label') || (e.labels && e.labels.length) || e.innerText.trim()
                   || e.title || e.getAttribute('aria-labelledby') || e.placeholder)
                 || e.tabIndex < 0)
    .map(e => e.outerHTML.slice(0, 160))"""


def _open(p, url: str, errors: list[str]):
    browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
    page = browser.new_page(viewport={"width": 1280, "height": 1600})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url, wait_until="load")
    page.wait_for_selector("#cfg-output-dir textarea", timeout=60_000)
    return browser, page


def _tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()
    assert not page.evaluate(UNLABELLED), f"{name} tab: controls without a label or keyboard access"


def test_a_new_users_path_from_a_preset_to_an_exported_model(webui, tmp_path, monkeypatch):
    url, root = webui
    shots = tmp_path / "screenshots"
    shots.mkdir()
    errors: list[str] = []
    with sync_playwright() as p:
        browser, page = _open(p, url, errors)
        _tab(page, "Train")

        # ---- keyboard: the guided row is reached by Tab from the page's start
        page.locator("body").focus()
        reached = set()
        for _ in range(40):
            page.keyboard.press("Tab")
            reached.add(page.evaluate("document.activeElement.closest('[id]')?.id"))
        assert {"preset", "model-pick", "cfg-method-stage", "cfg-method-finetuning", "data-pick"} <= reached

        # ---- the demo preset fills the form: its YAML is examples/demo.yaml
        _choose(page, "preset", "demo: full SFT of the demo model (README)")
        _wait_for_text(page, "#train-status", "filled from the preset")
        assert _value(page, "output_dir") == "runs/demo" and _value(page, "model.preset") == "demo"
        page.click("#preview-yaml")
        page.wait_for_function("document.querySelector('#command-line textarea').value.length > 0")
        preview = _text(page, "#yaml-preview .cm-content")
        monkeypatch.chdir(REPO)  # the demo's relative paths resolve against the repository, as the UI's root
        demo = load_config(str(REPO / "examples" / "demo.yaml"))
        assert load_config(None, base=yaml.safe_load(preview)) == demo
        command = page.locator("#command-line textarea").input_value()
        assert command == "shardforge train runs/demo/webui-config.yaml"

        # ---- the pickers: a preset model (what it is, beside it) and a data set found under the root
        _choose(page, "model-pick", "preset: demo")
        _wait_for_text(page, "#model-about", "parameters")
        assert "native backend" in _text(page, "#model-about")
        _choose(page, "data-pick", "examples/data/demo_sharegpt.jsonl (sharegpt)")
        page.wait_for_function(f"document.querySelector('#{form.BY_KEY['data.train'].elem_id} textarea')"
                               ".value.includes('demo_sharegpt')")  # fmt: skip
        assert yaml.safe_load(_value(page, "data.train")) == [
            {"path": "examples/data/demo_sharegpt.jsonl", "format": "sharegpt"}
        ]
        # the config's own message, under the field it is about
        _fill(page, "train.micro_batch", "0")
        page.click("#preview-yaml")
        _wait_for_text(page, "#train-status", "error")
        assert "greater than or equal to 1" in _text(page, "#cfg-train-micro-batch")
        _fill(page, "train.micro_batch", "4")

        # ---- the stage decides the sections: DPO's shown, SFT's folded away; every one on request
        assert page.locator("#section-method-sft").is_visible()
        assert not page.locator("#section-method-pref").is_visible()
        _choose(page, "cfg-method-stage", "dpo")
        page.wait_for_selector("#section-method-pref", state="visible")
        assert not page.locator("#section-method-sft").is_visible()
        page.locator("#section-advanced").get_by_text("advanced").first.click()
        page.locator("#show-all input").check()
        page.wait_for_selector("#section-method-sft", state="visible")
        assert page.locator("#section-method-rl").is_visible()
        assert page.locator("#section-parallel").is_visible()
        page.locator("#show-all input").uncheck()
        _choose(page, "cfg-method-stage", "sft")
        page.wait_for_selector("#section-method-pref", state="hidden")

        # ---- data preview with the length histogram
        page.click("#preview-data")
        page.wait_for_selector("#data-preview mark.sf-target", timeout=60_000)
        page.wait_for_selector("#length-chart img", timeout=30_000)
        assert "records:" in _text(page, "#length-figures") and "tokens" in _text(page, "#length-figures")

        # ---- plan: the chart, and its figures equal the planner table's
        page.click("#plan")
        page.wait_for_selector("#plan-chart img", timeout=120_000)
        figures = _table(page, "#plan-figures")
        first = [r for r in figures if r["layout"].startswith("#1 ") and r["what"] == "memory GiB"]
        table = _text(page, "#plan-table .cm-content")
        shown = float(re.search(r"memory GiB\W+([0-9.]+)", table).group(1))
        assert abs(sum(float(r["value"]) for r in first) - shown) < 0.011
        assert {r["part"] for r in first} >= {"params", "grads", "optimizer", "activations"}
        page.screenshot(path=str(shots / "1-train.png"), full_page=True)

        # ---- Runs: 20 steps with a checkpoint; every curve draws while it runs
        _fill(page, "train.steps", "20")
        _fill(page, "train.log_every", "2")
        _fill(page, "train.eval_every", "10")
        _fill(page, "checkpoint.every", "20")
        _tab(page, "Runs")
        page.click("#launch")
        _wait_for_text(page, "#run-status", "finished", 300_000)
        page.wait_for_selector("#curves img", timeout=30_000)
        for series in ("loss", "eval_loss", "lr", "tokens_per_s", "mfu"):  # the curves' text: each one's last
            _wait_for_text(page, "#curve-figures", f"{series} ")
        assert "done: 20 steps" in page.locator("#run-log textarea").input_value()
        assert (root / "runs" / "demo" / "final" / "config.json").is_file()
        assert _text(page, "#resolved-config .cm-content").startswith("output_dir: runs/demo")
        page.screenshot(path=str(shots / "2-runs.png"), full_page=True)

        # ---- Evaluate the result: BLEU/ROUGE of its answers to the demo's eval set
        _tab(page, "Train")
        page.click("#rescan")  # the pickers look under the root again: the run's final/ is there now
        _tab(page, "Evaluate")
        _choose(page, "eval-model", "runs/demo/final")
        _choose(page, "eval-data", "examples/data/demo_eval.jsonl (alpaca)")
        page.locator("#eval-samples input").fill("8")
        page.locator("#eval-tokens input").fill("16")
        page.click("#evaluate")
        _wait_for_text(page, "#eval-status", "done", 300_000)
        metrics = json.loads((root / "eval" / "runs-demo-final" / "predict_results.json").read_text())
        assert "predict_bleu-4" in metrics and "predict_bleu-4" in _text(page, "#eval-metrics")
        page.screenshot(path=str(shots / "3-evaluate.png"), full_page=True)

        # ---- Chat on the result: the reply grows on the page as tokens arrive
        _tab(page, "Chat")
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
        page.locator("#chat-input textarea").fill("Uppercase the text.\\nhello world")
        page.click("#chat-send")
        page.wait_for_function("document.querySelectorAll('#chatbot .bot').length > 0", timeout=60_000)
        page.wait_for_timeout(3000)
        sizes = page.evaluate("window.__sizes")
        page.screenshot(path=str(shots / "4-chat.png"), full_page=True)
        assert len({s for s in sizes if s > 0}) >= 2, f"the reply did not stream: {sizes}"

        # ---- Export the step-20 checkpoint as an HF folder
        _tab(page, "Export")
        page.locator("#export-source textarea").fill("runs/demo")
        page.locator("#export-to textarea").fill("exports/demo-hf")
        page.click("#export")
        _wait_for_text(page, "#export-result", "exported", 120_000)
        assert (root / "exports" / "demo-hf" / "config.json").is_file()
        page.screenshot(path=str(shots / "5-export.png"), full_page=True)

        # ---- Stop a long run, its curves overlaid on the first run's
        _tab(page, "Train")
        _choose(page, "preset", "demo: full SFT of the demo model (README)")
        _wait_for_text(page, "#train-status", "filled from the preset")
        _fill(page, "output_dir", "runs/long")
        _fill(page, "train.steps", "100000")
        _fill(page, "train.log_every", "2")
        _tab(page, "Runs")
        _choose(page, "compare-runs", "runs/demo")
        page.click("#launch")
        _wait_for_text(page, "#run-status", "running", 30_000)
        page.wait_for_function(
            "document.querySelector('#run-log textarea').value.includes('step=6 ')", timeout=120_000
        )
        _wait_for_text(page, "#curve-figures", "runs/long: loss ")  # both runs, the first to its end
        assert re.search(r"runs/demo: loss [0-9.]+ at step 20;", _text(page, "#curve-figures"))
        page.screenshot(path=str(shots / "6-runs-compared.png"), full_page=True)
        page.click("#stop")
        page.wait_for_function(
            "/stopped|ended/.test(document.querySelector('#run-status').innerText)", timeout=60_000
        )

        # ---- Load YAML: the first run's file back into the form
        _tab(page, "Train")
        page.locator("#load-path textarea").fill("runs/demo/webui-config.yaml")
        page.click("#load-yaml")
        _wait_for_text(page, "#train-status", "loaded")
        assert _value(page, "train.steps") == "20" and _value(page, "output_dir") == "runs/demo"
        browser.close()
    assert not errors, f"console errors in the page: {errors}"
    assert len(list(shots.glob("*.png"))) == 6


def _table(page, selector: str) -> list[dict[str, str]]:
    """An HTML table's rows as dicts by header."""
    return page.evaluate(f"""() => {{
        const t = document.querySelector({selector!r} + ' table');
        const head = [...t.querySelectorAll('thead th')].map(c => c.innerText.trim());
        return [...t.querySelectorAll('tbody tr')].map(r => Object.fromEntries(
            [...r.querySelectorAll('td')].map((c, i) => [head[i], c.innerText.trim()])));
    }}""")


def test_an_lf_users_dataset_info_folder(tmp_path):
    """LLaMA-Factory's own data folder (its dataset_info.json with the identity and alpaca demo entries):
    the picker lists its entries by name, the YAML names them as LF does, the preview shows LF's records."""
    from tests.lf.reference_env import reference

    lf_data = reference().src / "data"
    info = json.loads((lf_data / "dataset_info.json").read_text())
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    kept = {name: info[name] for name in ("identity", "alpaca_en_demo")}
    (root / "data" / "dataset_info.json").write_text(json.dumps(kept, indent=2))
    for entry in kept.values():
        shutil.copy(lf_data / entry["file_name"], root / "data" / entry["file_name"])
    shutil.copytree(REPO / "examples" / "data" / "tokenizer", root / "tokenizer")
    url, server = _serve(tmp_path, root)
    errors: list[str] = []
    try:
        with sync_playwright() as p:
            browser, page = _open(p, url, errors)
            _fill(page, "output_dir", "runs/identity")
            _choose(page, "model-pick", "preset: demo")
            page.wait_for_function(f"document.querySelector('#{form.BY_KEY['model.tokenizer'].elem_id} "
                                   "textarea').value == 'tokenizer'")  # fmt: skip
            options = page.locator("#data-pick input").first
            options.click()
            listed = page.locator("#data-pick [role=option]").all_inner_texts()  # this picker's own list
            assert listed == ["identity (data/dataset_info.json)", "alpaca_en_demo (data/dataset_info.json)"]
            options.blur()
            _choose(page, "data-pick", "identity (data/dataset_info.json)")
            _choose(page, "data-pick", "alpaca_en_demo (data/dataset_info.json)")
            page.wait_for_function(f"document.querySelector('#{form.BY_KEY['data.train'].elem_id} textarea')"
                                   ".value.includes('alpaca_en_demo')")  # fmt: skip
            page.click("#preview-yaml")
            page.wait_for_function("document.querySelector('#command-line textarea').value.length > 0")
            tree = yaml.safe_load(_text(page, "#yaml-preview .cm-content"))
            assert tree["data"]["train"] == [
                {"name": "identity", "dataset_info": "data/dataset_info.json"},
                {"name": "alpaca_en_demo", "dataset_info": "data/dataset_info.json"},
            ]
            page.click("#preview-data")
            page.wait_for_selector("#data-preview mark.sf-target", timeout=60_000)
            first = json.loads((root / "data" / "identity.json").read_text())[0]
            assert first["instruction"] in _text(page, "#data-preview")
            assert first["output"].split("{{")[0].strip() in _text(page, "#data-preview")
            page.screenshot(path=str(tmp_path / "lf-train.png"), full_page=True)
            # ---- a run launched and left going: stopping the UI stops it (as Ctrl-C), no orphan
            _fill(page, "train.steps", "100000")
            _fill(page, "train.log_every", "1")
            _tab(page, "Runs")
            page.click("#launch")
            log = root / "runs" / "identity" / "webui-train.log"
            page.wait_for_function(
                "document.querySelector('#run-log textarea').value.includes('step=1 ')", timeout=120_000
            )
            browser.close()
    finally:
        os.killpg(server.pid, 15)
        server.wait(60)
    assert not errors, f"console errors in the page: {errors}"
    assert log.read_text().rstrip().endswith("interrupted")
    assert "the launched run: stopped" in (tmp_path / "webui.log").read_text()
    running = subprocess.run(["pgrep", "-f", str(root / "runs" / "identity")], capture_output=True, text=True)
    assert running.stdout == "", "the launched run outlived the web UI"
