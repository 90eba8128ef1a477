"""Errors carry their field: ``HeadkitError.field`` names the config field or argument and
``value`` the offending value, so callers (the command line) need not read the message."""

from __future__ import annotations

import pytest

from headkit import POOLINGS, ConfigError, HeadConfig, HeadkitError
from headkit.cli.main import main
from headkit.probe.data import parse_layers


def test_a_plain_error_still_takes_one_message() -> None:
    e = ConfigError("something is wrong")
    assert (str(e), e.field, e.value) == ("something is wrong", None, None)
    assert isinstance(e, ValueError) and isinstance(e, HeadkitError)


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"num_layers": 0}, "num_layers", 0),
        ({"loss_weight": -1.0}, "loss_weight", -1.0),
        ({"pooling": "median"}, "pooling", "median"),
    ],
)
def test_head_config_errors_name_their_field_and_value(kwargs, field, value) -> None:
    with pytest.raises(ConfigError) as e:
        HeadConfig("h", num_outputs=2, **kwargs)
    assert (e.value.field, e.value.value) == (field, value)


def test_registry_and_argument_errors_name_their_field() -> None:
    with pytest.raises(ConfigError) as e:
        POOLINGS.get("median")
    assert (e.value.field, e.value.value) == ("pooling", "median")
    with pytest.raises(ConfigError) as e:
        parse_layers("1:x", 4)
    assert (e.value.field, e.value.value) == ("layers", "1:x")


def test_the_command_line_reports_an_error_as_its_option(tmp_path, capsys) -> None:
    data = tmp_path / "d.csv"
    data.write_text("text,label\na,0\nb,1\n")
    out = tmp_path / "out"
    code = main(["probe", "--model", "packaged:nope", "--data", str(data), "--output", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "headkit probe: error: argument --model: model='packaged:nope'" in err
