"""core/model_names.py: Triton's own rule (core's ValidateModelName) and the narrower one for the names that
`transerve export` and `convert` write."""

from __future__ import annotations

import pytest

from transerve.core.model_names import MAX_LENGTH, ModelNameError, check_tool_name, triton_problem


@pytest.mark.parametrize("name", ["", "   ", "..", " .. ", "a/b", "/abs"])
def test_triton_refuses_empty_names_and_path_traversal(name):
    assert triton_problem(name) is not None


@pytest.mark.parametrize("name", ["bad name", "x.y", "ünïcode", "-dash", ".hidden", "a" * 300])
def test_triton_takes_any_other_folder_name(name):
    assert triton_problem(name) is None


@pytest.mark.parametrize("name", ["transformer", "en_de", "opus-mt-en-de", "model.v2", "_private", "7b",
                                  "a" * MAX_LENGTH])
def test_the_tools_take_names_every_client_spells_plainly(name):
    check_tool_name(name, "--name")


@pytest.mark.parametrize(("name", "why"), [
    ("bad name", "a space is not allowed"),
    ("a/b", "path traversal"),
    ("..", "path traversal"),
    ("", "cannot be empty"),
    ("x:1", "':' is not allowed"),
    ("caf\u00e9", "'\u00e9' is not allowed"),
    ("-flag", "it may not begin with '-'"),
    (".hidden", "it may not begin with '.'"),
    ("a" * (MAX_LENGTH + 1), f"more than {MAX_LENGTH}"),
])
def test_the_tools_refuse_the_rest_in_one_line_naming_the_option(name, why):
    with pytest.raises(ModelNameError) as caught:
        check_tool_name(name, "--text-name")
    message = str(caught.value)
    assert message.startswith(f"--text-name {name!r} is not a model name: ") and why in message
    assert "\n" not in message
