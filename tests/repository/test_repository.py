"""Model folders, version folders and version policies."""

import pytest

from transerve.config.model_config import ConfigError, parse_config_text
from transerve.repository.fingerprint import fingerprint
from transerve.repository.repository import ModelRepository, available_versions, is_plain_model_name, select_versions


def policy(text: str):
    return parse_config_text(f"version_policy: {{ {text} }}").version_policy


def test_versions_are_numeric_folders(tmp_path):
    for name in ("1", "3", "10", "01", "abc"):
        (tmp_path / name).mkdir()
    (tmp_path / "2").write_text("a file, not a version")
    assert available_versions(tmp_path) == [1, 3, 10]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", [10]), ("latest: { num_versions: 2 }", [3, 10]), ("all: {}", [1, 3, 10]),
     ("specific: { versions: [1, 10] }", [1, 10])],
)
def test_version_policies(text, expected):
    chosen = policy(text) if text else parse_config_text("").version_policy
    assert select_versions(chosen, [1, 3, 10]) == expected


def test_specific_policy_naming_a_missing_version_fails():
    with pytest.raises(ConfigError, match=r"\[7\]"):
        select_versions(policy("specific: { versions: [1, 7] }"), [1, 3])


def test_scan_reports_duplicates_across_repositories(tmp_path):
    for repo in ("a", "b"):
        (tmp_path / repo / "shared").mkdir(parents=True)
    (tmp_path / "a" / "only_a").mkdir()
    found, duplicates = ModelRepository([tmp_path / "a", tmp_path / "b"]).scan()
    assert list(found) == ["only_a"]
    assert "two repositories" in duplicates["shared"]


@pytest.mark.parametrize("name", ["..", ".", "a/b", "/etc", "", "a\\b"])
def test_names_that_are_not_one_folder_are_refused(name, tmp_path):
    assert not is_plain_model_name(name)
    assert ModelRepository([tmp_path]).locate(name) is None


def test_fingerprint_changes_with_files_but_not_caches(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text("a")
    before = fingerprint(tmp_path)
    (tmp_path / "1" / "__pycache__").mkdir()
    (tmp_path / "1" / "__pycache__" / "x.pyc").write_text("cache")
    assert fingerprint(tmp_path) == before
    (tmp_path / "1" / "model.py").write_text("ab")
    assert fingerprint(tmp_path) != before
