"""The scripts' scratch system (system.scratch_system) refuses to start, naming what is missing,
before it sets up Django or creates a database."""

import pytest

from tests.browser import system


@pytest.fixture
def browser(monkeypatch, tmp_path):
    """Settings a scratch system can start with, and a browser path that exists once written."""
    monkeypatch.setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/unused")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/15")
    path = tmp_path / "chromium"
    monkeypatch.setattr(system, "CHROMIUM", str(path))
    return path


@pytest.mark.parametrize(
    ("env", "chromium", "problem"),
    [
        ({"DATABASE_URL": "sqlite:///scratch.db"}, True, "set DATABASE_URL"),
        ({"REDIS_URL": ""}, True, "set DATABASE_URL .* and REDIS_URL"),
        ({}, False, "chromium is missing"),
    ],
)
def test_scratch_system_names_what_is_missing(monkeypatch, browser, env, chromium, problem):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if chromium:
        browser.write_text("")
    with pytest.raises(RuntimeError, match=problem):
        with system.scratch_system("never"):
            pytest.fail("a scratch system started without what it needs")


def test_nothing_missing_is_no_problem(browser):
    browser.write_text("")
    assert system.scratch_system_problem() is None
