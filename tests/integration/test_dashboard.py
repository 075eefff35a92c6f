"""The dashboard in a real browser (headless Chromium from Debian's packages, driven by
Selenium through Debian's chromedriver) against the real stack: one task of two attempts
runs through the real proxy, vLLM and runner; the stream worker assembles and groups it;
the dashboard (the stack's ``dashboard`` component) must list both rollouts, show one's
waterfall with the LLM call's prompt and completion text (decoded from the recorded token
ids), its agent account and advantage, and the training and pipeline pages must load.
Screenshots go to ``tests/artifacts/dashboard/`` (gitignored)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import httpx
import openai
import pytest

from spanrl.core.edge import bearer_headers, token_value
from spanrl.infra.stack import Stack
from spanrl.producers.runner import Runner, make_task

pytestmark = pytest.mark.integration

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "dashboard"


@pytest.fixture(scope="module")
def dashboard(settings):
    """The stack's parts this test needs, the dashboard among them (started if missing)."""
    Stack(settings).up(["kafka", "minio", "vllm", "proxy", "stream", "dashboard"])
    return settings.dashboard_url


@pytest.fixture(scope="module")
def browser():
    from spanrl.infra.dashboard.screenshots import headless_chromium

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        with headless_chromium() as driver:
            yield driver
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


def _run_one_task(settings, task_id: str) -> dict[str, str]:
    """Two attempts of one task through the real proxy; returns rollout id -> completion text."""
    texts: dict[str, str] = {}

    async def agent(ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        out = await client.chat.completions.create(
            model=settings.model_name, max_tokens=12, temperature=1.0,
            messages=[{"role": "user", "content": ctx.task["q"]}], extra_headers={"x-spanrl-agent": "painter"})
        await client.close()
        texts[ctx.rollout_id] = out.choices[0].message.content
        return float(len(texts) % 2)  # the two attempts get rewards 1 and 0: a non-zero advantage

    task = make_task(json.dumps({"q": "Name a colour."}), group_size=2, task_id=task_id, timeout_s=60)
    runner = Runner(agent, concurrency=1, proxy_url=settings.proxy_url, settings=settings, telemetry=False)
    results = asyncio.run(asyncio.wait_for(runner.run_tasks([task]), 120))
    assert [r.status for r in results[0]] == ["succeeded", "succeeded"]
    return texts


def _shot(driver, name: str) -> Path:
    height = driver.execute_script("return document.body.scrollHeight")
    driver.set_window_size(1400, min(max(height + 80, 700), 2400))
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    return path


def test_dashboard_shows_the_rollouts_and_a_trace(settings, dashboard, browser):
    from selenium.webdriver.common.by import By

    task_id = f"dash-{uuid.uuid4().hex[:8]}"
    texts = _run_one_task(settings, task_id)
    headers = bearer_headers(settings.auth_token)

    # the dashboard's view catches up: both rollouts ended, their calls accounted and grouped
    deadline, rows = time.monotonic() + 90, []
    while time.monotonic() < deadline:
        rows = [r for r in httpx.get(f"{dashboard}/api/rollouts", headers=headers, timeout=10).json()
                if r["task_id"] == task_id]
        if len(rows) == 2 and all(r["status"] == "succeeded" and r["agents"] == ["painter"] for r in rows):
            break
        time.sleep(2)
    assert sorted(r["rollout_id"] for r in rows) == sorted(texts), rows
    assert sorted(r["reward"] for r in rows) == [0.0, 1.0] and all(r["llm_calls"] == 1 for r in rows)

    token = token_value(settings.auth_token)
    browser.get(f"{dashboard}/?task={task_id}" + (f"&token={quote(token)}" if token else ""))
    assert browser.title == "spanrl · rollouts"
    listed = {e.get_attribute("data-rollout") for e in browser.find_elements(By.CSS_SELECTOR, "tr.rollout-row")}
    assert listed == set(texts)
    if token:  # the token went into a cookie; the address no longer carries it
        assert "token=" not in browser.current_url and token not in browser.page_source
    _shot(browser, "rollouts")

    rid = sorted(texts)[0]
    browser.find_element(By.CSS_SELECTOR, f'tr[data-rollout="{rid}"] a').click()
    assert rid in browser.title or browser.find_element(By.TAG_NAME, "h2").text.endswith(rid)
    assert browser.find_elements(By.CSS_SELECTOR, "#waterfall svg")
    completion = browser.find_element(By.CSS_SELECTOR, "pre.completion").text
    prompt = browser.find_element(By.CSS_SELECTOR, "pre.prompt").text
    assert texts[rid].strip() in completion and "Name a colour." in prompt
    # its call account (whether it trained) comes with its transitions, when the worker's
    # transaction commits; the page may have been drawn before: wait for it
    deadline = time.monotonic() + 60
    while True:
        cells = browser.find_elements(By.CSS_SELECTOR, "tr.span-row.kind-llm td")
        if cells[4].text != "pending" or time.monotonic() > deadline:
            break
        time.sleep(2)
        browser.refresh()
    assert cells[3].text.split("\n")[0] == "painter" and cells[4].text == "yes"  # its agent; it trained
    _shot(browser, "rollout")

    # the advantage arrives with the task's samples (grouping): wait for it on the page
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        cells = browser.find_elements(By.CSS_SELECTOR, "tr.span-row.kind-llm td")
        if cells[6].text.strip():
            break
        time.sleep(3)
        browser.refresh()
    # rewards 1 and 0 in a group of two: GRPO advantage ±0.5 / (0.5 + 1e-6), shown rounded
    assert abs(float(cells[6].text)) == pytest.approx(1.0, abs=0.01), cells[6].text
    _shot(browser, "rollout")

    for path, title, table in (("/training", "spanrl · training", "versions"),
                               ("/pipeline", "spanrl · pipeline", "lag")):
        browser.get(dashboard + path)
        assert browser.title == title and browser.find_elements(By.ID, table)
        _shot(browser, path.strip("/"))
