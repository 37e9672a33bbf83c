"""`serve --workers N`: what each worker is started with, and the refusal without a
shared ledger (the multi-process behaviour is in tests/integration/test_shared_ledger.py)."""

import logging
from pathlib import Path

import pytest

from kvgateway.cli import build_parser, main
from kvgateway.commands.workers import worker_args


def test_each_worker_gets_the_serve_flags_its_index_and_the_metrics_dir():
    args = build_parser().parse_args(
        [
            "serve",
            "--config",
            "g.yaml",
            "--port",
            "8080",
            "--watch",
            "--ledger-url",
            "redis://r:6379/0",
            "--workers",
            "3",
        ]
    )
    got = build_parser().parse_args(worker_args(args, 2, "/tmp/m"))
    assert (got.config, got.port, got.watch, got.ledger_url) == (
        "g.yaml",
        8080,
        True,
        "redis://r:6379/0",
    )
    assert (got.workers, got.worker_index, got.metrics_dir) == (1, 2, "/tmp/m")


def test_more_than_one_worker_needs_a_shared_ledger(tmp_path: Path, capsys):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(
        "models: [{name: m}]\n"
        "tiers: [{name: t, backends: [{name: a, url: 'http://127.0.0.1:9', model: m}]}]\n"
    )
    assert main(["serve", "--config", str(cfg), "--workers", "2"]) == 2
    assert "needs the shared ledger" in capsys.readouterr().err
    # A worker the supervisor (re)starts reads the file again: if the ledger is gone
    # from it, the worker refuses to start (alone, "local", it would admit past the
    # budget the other workers share).
    worker = ["serve", "--config", str(cfg), "--worker-count", "2", "--worker-index", "0"]
    assert main([*worker, "--metrics-dir", str(tmp_path)]) == 2
    assert "needs the shared ledger" in capsys.readouterr().err
    assert main(["serve", "--config", str(cfg), "--ledger-url", "http://r:1"]) == 2
    assert "--ledger-url: expected redis://" in capsys.readouterr().err


@pytest.mark.parametrize("n", ["0", "-1"])
def test_workers_must_be_positive(tmp_path: Path, capsys, n):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(
        "models: [{name: m}]\n"
        "tiers: [{name: t, backends: [{name: a, url: 'http://127.0.0.1:9', model: m}]}]\n"
    )
    assert main(["serve", "--config", str(cfg), "--workers", n]) == 2


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--port", "89536", "expected a port from 0 to 65535"),
        ("--port", "-5", "expected a port from 0 to 65535"),
        ("--log-level", "bogus", "expected one of DEBUG"),
        ("--drain-delay-s", "nan", "expected a finite number >= 0"),
        ("--drain-delay-s", "-3", "expected a finite number >= 0"),
    ],
)
def test_command_line_values_are_checked_where_typed(tmp_path: Path, capsys, flag, value, says):
    """A value out of range is a usage error (exit 2) saying what is expected: unchecked,
    --port 89536 would bind port 24000 (mod 65536) while the log says 89536, and
    --log-level bogus would end in a traceback."""
    cfg = tmp_path / "g.yaml"
    cfg.write_text("models: [{name: m}]\n")
    with pytest.raises(SystemExit) as err:
        main(["serve", "--config", str(cfg), flag, value])
    assert err.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("level", ["debug", "WARN", "fatal", "Critical"])
def test_every_level_name_logging_knows_is_taken(level):
    from kvgateway.config.argtypes import log_level

    assert logging.getLevelName(log_level(level)) != f"Level {log_level(level)}"


def test_config_schema_to_a_path_it_cannot_write(tmp_path: Path, capsys):
    assert main(["config-schema", "-o", str(tmp_path / "no" / "such" / "x.json")]) == 1
    assert "cannot write" in capsys.readouterr().err
