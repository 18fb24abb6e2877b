"""Lesson 04's bubble explorer, used the way a learner uses it: in JupyterLab, in a real browser.

JupyterLab starts on a free local port (no token, its own runtime, config and data folders)
serving a copy of lessons/04_pipeline_parallel.ipynb (so autosave cannot touch the lesson);
headless Chromium, driven by selenium, opens it, runs the explorer's cell, presses the right
arrow key on the micro-batches slider and waits until the page shows the new bubble fraction,
which must be the simulator's for the new setting, and a new picture.

`make browser-test` runs this (and fails if Chromium is missing); in `make test` it is skipped,
with the reason, where Chromium, chromedriver or selenium are absent (the skip is allowed under
MINITRON_STRICT only then: tests/strict_skips.py). `SCREENSHOT=path make browser-test` keeps a
screenshot of the page after the change.
"""
import importlib.util
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from minitron.pipeline import make_schedule
from minitron.pipeline.simulate import simulate

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "04_pipeline_parallel.ipynb"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
NO_CHROMIUM = "needs Chromium and chromedriver (apt-get install chromium chromium-driver)"
NO_SELENIUM = "needs selenium (pip install -e '.[browser]')"
SLOW = 240          # seconds a step may take: JupyterLab's start, the kernel's imports on a busy 2-core machine


def _require(ok: bool, reason: str):
    if not ok:
        if os.environ.get("MINITRON_BROWSER_TEST") == "1":     # make browser-test: no excuses
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on a free port serving a copy of lesson 04; yields its URL."""
    _require(importlib.util.find_spec("jupyterlab") is not None, "needs jupyterlab (pip install -e '.[course]')")
    served = tmp_path / "served"
    served.mkdir()
    shutil.copy(LESSON, served / LESSON.name)
    port, home = _free_port(), tmp_path / "jupyter"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_CONFIG_DIR=str(home / "config"),
               JUPYTER_DATA_DIR=str(home / "data"), JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"))
    env.pop("MPLBACKEND", None)      # the kernel's own inline backend, as in a learner's lab
    news = home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false"}')     # no "get notified about news?" toast on the page
    log = open(tmp_path / "lab.log", "w")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--IdentityProvider.token=", "--ServerApp.password=", f"--ServerApp.root_dir={served}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SLOW
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start: {(tmp_path / 'lab.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield f"{url}/lab/tree/{LESSON.name}"
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture
def browser():
    _require(CHROMIUM is not None and CHROMEDRIVER is not None, NO_CHROMIUM)
    _require(importlib.util.find_spec("selenium") is not None, NO_SELENIUM)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1100"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)   # no driver download
    try:
        yield driver
    finally:
        driver.quit()


def test_moving_a_slider_redraws_the_bubble(browser, lab, tmp_path):   # browser first: it may skip
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, SLOW, ignored_exceptions=(WebDriverException,))
    browser.get(lab)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell .cm-content"))
    # JupyterLab asks for a kernel only when the notebook's is unknown: take the one it offers.
    for button in browser.find_elements(By.CSS_SELECTOR, ".jp-Dialog .jp-mod-accept"):
        button.click()

    def explorer_cell(d):
        cells = d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")
        return next((c for c in cells if "explore(" in c.get_attribute("textContent")), False)

    cell = wait.until(explorer_cell)
    editor = cell.find_element(By.CSS_SELECTOR, ".cm-content")
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", cell)

    def clicked(_):
        editor.click()       # the editor exists before it can take a click while the page settles
        return True

    wait.until(clicked)
    editor.send_keys(Keys.SHIFT, Keys.ENTER)       # run this cell only: it imports what it needs

    def bubble_text(d):
        found = d.find_elements(By.CSS_SELECTOR, ".minitron-bubble")
        text = found[0].text if found else ""
        return text if text.startswith("bubble fraction: 0.") else False

    def picture(d):
        imgs = cell.find_elements(By.CSS_SELECTOR, ".widget-output img")
        return imgs[0].get_attribute("src") if imgs else False

    before, before_picture = wait.until(bubble_text), wait.until(picture)
    assert before == f"bubble fraction: {float(simulate(make_schedule('1f1b', 4, 8)).bubble_fraction):.3f}"

    slider = next(s for s in cell.find_elements(By.CSS_SELECTOR, ".widget-slider")
                  if s.find_element(By.CSS_SELECTOR, ".widget-label").text == "micro-batches")
    handle = slider.find_element(By.CSS_SELECTOR, ".noUi-handle")
    handle.send_keys(Keys.ARROW_RIGHT)             # 8 -> 9 micro-batches, as a learner would

    after = wait.until(lambda d: (t := bubble_text(d)) and t != before and t)
    want = simulate(make_schedule("1f1b", 4, 9)).bubble_fraction
    assert after == f"bubble fraction: {float(want):.3f}" == "bubble fraction: 0.250"
    wait.until(lambda d: (p := picture(d)) and p != before_picture)
    shot = os.environ.get("SCREENSHOT")
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", cell)
    browser.save_screenshot(shot or str(tmp_path / "explorer.png"))
