"""Browser tests: Playwright drives Debian's headless Chromium (/usr/bin/chromium; nothing is ever
downloaded) against the whole system, started once for this package (tests/browser/system.py).

The system's rows are committed (its web server, Celery and daemon are other processes), so the
package ends by flushing the test database, as a transactional test would, before any other test
runs. Without Chromium the tests skip locally; with CI or REQUIRE_SERVICES=1 set they fail.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.management import call_command
from django.db import connection, connections
from playwright.sync_api import expect

from tests.browser.system import VIEWPORT, chromium_missing_reason, env_flag, launch_options, log_in, start_system
from tests.conftest import require_service

# Playwright's own waits: generous for a loaded two-core machine, far below the test timeout.
DEFAULT_TIMEOUT_MS = 20_000
expect.set_options(timeout=DEFAULT_TIMEOUT_MS)  # assertions too; Playwright's own is 5 s


def _require_browser() -> None:
    reason = chromium_missing_reason()
    if reason is None:
        return
    if env_flag("CI") or env_flag("REQUIRE_SERVICES"):
        pytest.fail(f"{reason}; CI or REQUIRE_SERVICES=1 forbids skipping the browser tests", pytrace=False)
    pytest.skip(reason)


def _flush(django_db_blocker) -> None:
    """Remove whatever the system committed, as a transactional test's teardown does."""
    with django_db_blocker.unblock():
        connections.close_all()
        call_command("flush", interactive=False, verbosity=0, reset_sequences=False)
        connections.close_all()


@pytest.fixture(scope="package")
def test_database(request, django_db_setup, django_db_blocker):
    """The test database, created here when pytest-django has not created it.

    pytest-django creates it only when some collected test asks for `db`, `transactional_db` or
    the django_db marker; browser tests use neither (their rows must outlive a test, and the
    system's own processes write to it), so when they run on their own it is created here.
    """
    from django.test.utils import setup_databases, teardown_databases
    from pytest_django.fixtures import _get_databases_for_setup

    aliases, _ = _get_databases_for_setup(request.session.items)
    if "default" in aliases:
        yield
        return
    with django_db_blocker.unblock():
        created = setup_databases(verbosity=0, interactive=False, aliases={"default"})
    try:
        yield
    finally:
        with django_db_blocker.unblock():
            teardown_databases(created, verbosity=0)


@pytest.fixture(scope="package")
def system(test_database, django_db_blocker, tmp_path_factory):
    """The started system (see tests/browser/system.py), shared by every browser test."""
    _require_browser()
    redis_url = os.environ.get("REDIS_URL", "")
    if not redis_url:
        require_service("REDIS_URL is not set")
    with django_db_blocker.unblock():
        if connection.vendor != "postgresql":
            require_service(f"the database is {connection.vendor}, not PostgreSQL (set DATABASE_URL)")
        try:
            started = start_system(scratch=tmp_path_factory.mktemp("browser-system"), redis_url=redis_url)
        except BaseException:
            _flush(django_db_blocker)
            raise
        # The subprocesses hold their own connections; ours must not sit idle meanwhile.
        connections.close_all()
    try:
        yield started
    finally:
        started.stop()
        _flush(django_db_blocker)


@pytest.fixture(scope="package")
def browser(system):
    # Imported here so that collecting the suite never needs Playwright's driver.
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(**launch_options())
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="package")
def signed_in_state(system, browser):
    """signed_in_state(role) -> cookies of a session of that role, logged in once per package
    through the login form (the password hash costs about a second on the server)."""
    states: dict[str, dict] = {}

    def get(role: str) -> dict:
        if role not in states:
            context = browser.new_context(base_url=system.url)
            try:
                log_in(context.new_page(), system.login(role))
                states[role] = context.storage_state()
            finally:
                context.close()
        return states[role]

    return get


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def open_page(system, browser, signed_in_state, request, tmp_path):
    """open_page(role=None, viewport=VIEWPORT) -> a new page in a fresh browser context, signed in
    as `role` ("operator", "admin", "tenant", "other_tenant") or anonymous.

    An uncaught JavaScript error on any page fails the test: a broken script is a broken page
    even when the assertions happened not to touch it. A failed test leaves a screenshot of each
    page and prints the system's logs.
    """
    contexts, pages, page_errors = [], [], []

    def open_(role: str | None = None, viewport: dict = VIEWPORT):
        context = browser.new_context(
            base_url=system.url, viewport=viewport, storage_state=signed_in_state(role) if role else None
        )
        context.set_default_timeout(DEFAULT_TIMEOUT_MS)
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda error, page=page: page_errors.append(f"{page.url}: {error}"))
        pages.append(page)
        return page

    yield open_
    report = getattr(request.node, "report_call", None)
    try:
        if report is not None and report.failed:
            for number, page in enumerate(pages):
                if not page.is_closed():
                    path = tmp_path / f"page-{number}.png"
                    page.screenshot(path=path, full_page=True)
                    print(f"----- page {number}: {page.url} (screenshot {path}) -----")
                    print(page.inner_text("body")[:3000])
            print(system.fleet.logs())
    finally:
        for context in contexts:
            context.close()
    if page_errors and report is not None and report.passed:
        pytest.fail("uncaught JavaScript errors:\n" + "\n".join(page_errors), pytrace=False)


@pytest.fixture
def orm(django_db_blocker):
    """orm(function, *args) runs database code for a test and returns its result.

    It runs on a thread of its own: Playwright's sync API keeps an asyncio loop running on the
    test's thread, where Django rightly refuses synchronous database calls.
    """
    executor = ThreadPoolExecutor(max_workers=1)

    def call(function, *args, **kwargs):
        def run():
            try:
                return function(*args, **kwargs)
            finally:
                connections.close_all()

        with django_db_blocker.unblock():
            return executor.submit(run).result(timeout=60)

    yield call
    executor.shutdown()
