"""The browser end to end: Playwright driving Debian's chromium, headless, against the real
service processes (Daphne and a Celery worker on loopback, the embedded defaults: SQLite, the
filesystem broker and the database channel layer).

A person logs in, previews and submits a PPO job on the simulated cluster that asks for manual
approval, watches the drift chart grow without reloading, approves the controller's proposal,
sees the transition's DAG complete, and cancels the job. Screenshots go to
``test-artifacts/e2e/`` (gitignored; CI keeps them as artifacts).

Chromium missing is a failure, never a skip: ``make test`` installs it (its ``browser`` step).
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support import live

CHROMIUM = os.environ.get("NEREUS_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = live.REPO / "test-artifacts" / "e2e"
TIMEOUT_MS = 45_000
# A growth trace on 16 simulated H100s: as the responses grow, the controller proposes plan
# changes within the first steps and keeps proposing while the length drifts, so at 0.3 s a
# step a person has time to approve one; the job runs long enough after that for the approvals
# that go stale and the cancel at the end.
JOB = {
    "name": "e2e-sim",
    "kind": "ppo-sim",
    "model": "llama-3.1-8b",
    "gpu": "h100-sxm",
    "gpus": "16",
    "trace": "growth",
    "num_steps": "200",
    "pace_s": "0.3",
    "approval": "manual",
}


@pytest.fixture(scope="module")
def browser():
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(
            f"chromium not found at {CHROMIUM}: `make install` installs it "
            "(apt-get install -y chromium); the browser test must not be skipped"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: `make install` installs the dev extra")
    args = ["--disable-dev-shm-usage"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--no-sandbox")  # chromium refuses to sandbox as root
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        yield browser
        browser.close()


@pytest.fixture
def service(tmp_path):
    env = live.service_env(tmp_path)
    live.manage(env, "migrate", "--no-input")
    live.create_user_session(env, "alice")  # password pw-alice-1234
    with (
        live.web_server(env, tmp_path / "logs") as url,
        live.celery_worker(env, tmp_path / "logs"),
    ):
        yield url


@pytest.fixture
def shots(request):
    if ARTIFACTS.exists():
        shutil.rmtree(ARTIFACTS)
    ARTIFACTS.mkdir(parents=True)
    return ARTIFACTS


def _points(page, chart: str) -> int:
    return page.evaluate(
        "(id) => { const d = document.getElementById(id).data;"
        " return d && d[0] ? d[0].x.length : 0; }",
        chart,
    )


def test_submit_watch_approve_and_see_the_dag_complete(browser, service, shots):
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, base_url=service)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on(  # a failed fetch shows as a response below; anything else is a script error
        "console",
        lambda m: (
            problems.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.on(
        "response",
        lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 500 else None,
    )
    try:
        # Log in.
        page.goto("/jobs/")
        assert "/login/" in page.url
        page.fill("input[name=username]", "alice")
        page.fill("input[name=password]", "pw-alice-1234")
        page.click("button[type=submit]")
        page.wait_for_url("**/jobs/")

        # The submit form: field errors, then the preview, then submit.
        page.goto("/jobs/new/")
        assert page.input_value("input[name=name]") == "sft-demo"
        page.select_option("select[name=kind]", "ppo-sim")
        # The default name follows the kind until the user types one.
        assert page.input_value("input[name=name]") == "ppo-sim-demo"
        for name, value in JOB.items():
            selector = f"[name={name}]"
            if page.locator(f"select{selector}").count():
                page.select_option(f"select{selector}", value)
            else:
                page.fill(f"input{selector}", value)
        page.fill("input[name=gpus]", "0")
        page.click("#preview-button")
        page.locator(".preview-error").first.wait_for()
        assert "gpus" in page.locator(".preview-error").first.inner_text()
        page.fill("input[name=gpus]", JOB["gpus"])
        page.click("#preview-button")
        page.wait_for_function(
            "document.getElementById('preview-summary').textContent.includes('Predicted step time')"
        )
        assert page.locator("#preview-map .cell.td").count() > 0
        page.screenshot(path=shots / "1-submit-preview.png", full_page=True)
        page.click("#submit-button")
        page.wait_for_url("**/jobs/*/")
        job_url = page.url

        # The drift chart grows while the page stays loaded.
        page.evaluate("window.__sameDocument = true")
        page.wait_for_function("document.getElementById('live-status').textContent === 'live'")
        page.wait_for_function(
            "(document.getElementById('chart-genlen').data || [[]])[0].x.length >= 3"
        )
        before = _points(page, "chart-genlen")
        page.wait_for_function(
            f"document.getElementById('chart-genlen').data[0].x.length >= {before + 5}"
        )
        assert page.evaluate("window.__sameDocument === true"), "the page was reloaded"
        assert page.locator("text=simulated cluster").count() == 1
        page.screenshot(path=shots / "2-job-live.png", full_page=True)

        # Approve the controller's proposals (a newer one may supersede one: approve what
        # waits) until one that moves state is applied. A move of the units rebuilt every step
        # anyway (inference) moves no state: its DAG has no node, and the page says so.
        moved = False
        outcomes: list[str] = []
        for attempt in range(8):
            page.locator("#decide-form:not([hidden])").wait_for(state="visible")
            if not attempt:  # one picture: each takes a while, and proposals do not wait
                page.screenshot(path=shots / "3-approval.png", full_page=True)
            transitions = page.locator("#transitions tbody tr").count()
            decided = len(outcomes)
            page.fill("#decide-form textarea[name=comment]", "e2e: the move pays back")
            page.click("#decide-form button[value=approve]")
            page.wait_for_url(job_url)
            page.wait_for_function(
                "[...document.querySelectorAll('#decisions td')].filter(td =>"
                f" /^approve \\d+: /.test(td.textContent)).length > {decided}"
                " || !document.getElementById('decide-form').hidden"
            )
            outcomes = [
                text
                for text in page.locator("#decisions td", has_text="approve ").all_inner_texts()
                if text.startswith("approve ")
            ]
            if not outcomes or ": applied" not in outcomes[0]:  # newest first
                continue  # stale or superseded: approve what waits now
            page.wait_for_function(
                f"document.querySelectorAll('#transitions tbody tr').length > {transitions}"
                " && document.getElementById('dag').dataset.state === 'done'"
            )
            if page.locator("#dag g.node").count() > 0:
                moved = True
                break
            assert "No state moved" in page.locator("#dag-summary").inner_text()
        assert moved, f"no approval moving state was applied: {outcomes}"

        # The transition that followed the approval: its DAG drawn, complete.
        nodes = page.locator("#dag g.node")
        assert nodes.count() > 0
        assert nodes.count() == page.locator("#dag g.node.state-done").count()
        assert page.locator("#dag g.node.critical").count() >= 1
        assert "complete" in page.locator("#dag-summary").inner_text()
        page.locator("#dag").scroll_into_view_if_needed()
        page.screenshot(path=shots / "4-dag-complete.png", full_page=True)
        # The links' load, from the first probing on (timed again every 15 minutes of the job).
        page.wait_for_function("!document.getElementById('link-load').hidden")
        assert "(simulated)" in page.locator("#link-load").inner_text()

        # Cancel from the page, saying yes to the question it asks; the job stops at its next
        # step.
        asked = []
        page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
        page.click("button.danger:has-text('Cancel')")
        page.wait_for_url(job_url)
        page.wait_for_function(
            "['cancelled', 'cancelling'].includes("
            "(document.getElementById('job-state') || {}).textContent)"
        )
        assert asked and asked[0].startswith("Cancel this job?")

        # Dark mode follows the system setting.
        page.emulate_media(color_scheme="dark")
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(15, 20, 25)", background
        page.wait_for_function(
            "document.getElementById('chart-genlen').layout.font.color === '#e6edf3'"
        )
        page.screenshot(path=shots / "5-dark-mode.png", full_page=True)
    except Exception:
        page.screenshot(path=shots / "failure.png", full_page=True)
        raise
    finally:
        context.close()
    assert not problems, problems
