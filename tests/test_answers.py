"""Bad answers are refused with one clear line, and nothing is written."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from helpers import ROOT, render

# (answer, a word the message must contain so the user knows what is wrong)
BAD_PACKAGE_NAMES = [
    ("class", "keyword"),
    ("my-pkg", "identifier"),
    ("torch", "shadow"),
    ("1abc", "identifier"),
    ("os", "shadow"),
    ("tests", "shadow"),
    ("test", "shadow"),
    ("MyPkg", "identifier"),
]


def _message(excinfo: pytest.ExceptionInfo[ValueError]) -> str:
    message = str(excinfo.value)
    assert "\n" not in message.strip(), f"message is not one line: {message!r}"
    return message


@pytest.mark.parametrize(("answer", "word"), BAD_PACKAGE_NAMES)
def test_bad_package_name_is_refused(tmp_path, answer, word):
    dest = tmp_path / "project"
    with pytest.raises(ValueError) as excinfo:
        render(dest, {"package_name": answer})
    message = _message(excinfo)
    assert "package_name" in message and f"'{answer}'" in message and word in message
    assert not dest.exists() or not any(dest.iterdir())


def test_a_package_name_too_long_for_a_file_system_is_refused(tmp_path):
    dest = tmp_path / "project"
    with pytest.raises(ValueError) as excinfo:
        render(dest, {"package_name": "a" * 300})  # Copier itself would fail: name too long
    message = _message(excinfo)
    assert "package_name is 300 characters long; use at most 64" in message
    assert not dest.exists() or not any(dest.iterdir())


def test_bad_email_is_refused(tmp_path):
    dest = tmp_path / "project"
    with pytest.raises(ValueError) as excinfo:
        render(dest, {"author_email": "not-an-email"})
    message = _message(excinfo)
    assert "author_email" in message and "'not-an-email'" in message and "email" in message
    assert not dest.exists() or not any(dest.iterdir())


def test_bad_project_name_is_refused(tmp_path):
    with pytest.raises(ValueError) as excinfo:
        render(tmp_path / "project", {"project_name": "9 lives!"})
    assert "project_name" in _message(excinfo)


def test_cli_ends_with_the_clear_message_and_fails(tmp_path):
    """Copier's CLI prints its own traceback for answers given with -d (upstream behaviour;
    interactive prompts show only the message), but the last line is the message itself."""
    dest = tmp_path / "project"
    copy = [sys.executable, "-m", "copier", "copy", "--defaults", "--vcs-ref", "HEAD"]
    result = subprocess.run(
        [*copy, "-d", "package_name=my-pkg", ROOT, dest],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1  # copier's exit code for an error it reports
    last_line = result.stderr.strip().splitlines()[-1]
    assert "package_name 'my-pkg' is not a lowercase Python identifier" in last_line
    assert not dest.exists()


def test_reserved_names_cover_this_pythons_standard_library():
    """The validator's list is written out in copier.yml (no Jinja extension may import sys):
    it must not drift behind the standard library of the Python running the tests."""
    config = yaml.safe_load((ROOT / "copier.yml").read_text())
    reserved = set(config["reserved_module_names"]["default"])
    stdlib = {n for n in sys.stdlib_module_names if n == n.lower() and not n.startswith("_")}
    assert not stdlib - reserved, f"add to reserved_module_names: {sorted(stdlib - reserved)}"
    assert {"torch", "test", "tests"} <= reserved
