"""Without Debian's Chromium the browser tests skip on a developer's machine, but fail under CI or
REQUIRE_SERVICES=1, so a CI machine without the browser can never pass by skipping them."""

import pytest

from tests.browser import conftest, system


@pytest.mark.parametrize(
    ("env", "outcome"),
    [
        ({}, pytest.skip.Exception),
        ({"CI": "true"}, pytest.fail.Exception),
        ({"REQUIRE_SERVICES": "1"}, pytest.fail.Exception),
    ],
)
def test_missing_chromium_skips_only_outside_ci(monkeypatch, tmp_path, env, outcome):
    monkeypatch.setattr(system, "CHROMIUM", str(tmp_path / "chromium"))
    for name in ("CI", "REQUIRE_SERVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(outcome, match="chromium is missing"):
        conftest._require_browser()


def test_present_chromium_is_used(monkeypatch, tmp_path):
    browser = tmp_path / "chromium"
    browser.write_text("")
    monkeypatch.setattr(system, "CHROMIUM", str(browser))
    monkeypatch.setenv("REQUIRE_SERVICES", "1")
    try:
        conftest._require_browser()
    except (pytest.skip.Exception, pytest.fail.Exception) as exc:  # a skip would otherwise pass unseen
        pytest.fail(f"a present browser was refused: {exc}")
    assert system.launch_options() == {"executable_path": str(browser), "headless": True}
