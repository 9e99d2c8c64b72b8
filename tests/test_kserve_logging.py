"""Triton's logging extension (get_log_settings / update_log_settings): Triton 2.51's rules and
words, applied to the front door's own logging and shared by the node's front-door processes."""

from __future__ import annotations

import io
import logging
import os

import pytest
from tritonclient.grpc import service_pb2

from batchyard.kserve_common import KServeError
from batchyard.kserve_logging import LogSettings, parse_grpc_update, parse_http_update, setting_of_level

START = setting_of_level(logging.INFO)


def _error(fn) -> tuple:
    with pytest.raises(KServeError) as e:
        fn()
    return e.value.http_status, e.value.code.name, e.value.message


def test_http_updates_are_read_with_tritons_rules_and_words():
    assert parse_http_update({"log_info": False, "log_verbose_level": 2, "log_format": "ISO8601", "x": 1}) == {
        "log_info": False, "log_verbose_level": 2, "log_format": "ISO8601"}
    assert parse_http_update([]) == {} and parse_http_update({"log_error": None, "log_file": None}) == {}
    assert parse_http_update({"log_verbose_level": (1 << 32) + 3}) == {"log_verbose_level": 3}  # (an int32)
    assert parse_http_update({"log_verbose_level": 1 << 40}) == {"log_verbose_level": 0}
    assert _error(lambda: parse_http_update({"log_file": ""})) == (
        501, "UNIMPLEMENTED", "log file location can not be updated through network protocol")
    for value in ("true", 1, 0.0):
        assert _error(lambda: parse_http_update({"log_warning": value})) == (
            500, "INTERNAL", "attempt to access JSON non-boolean as boolean")
    for value in (-1, 1.5, "1", True, 1 << 64):
        assert _error(lambda: parse_http_update({"log_verbose_level": value})) == (
            500, "INTERNAL", "attempt to access JSON non-unsigned-integer as unsigned-integer")
    assert _error(lambda: parse_http_update({"log_format": 1})) == (
        500, "INTERNAL", "attempt to access JSON non-string as string")
    assert _error(lambda: parse_http_update({"log_format": "iso8601"})) == (
        503, "UNAVAILABLE", "invalid argument for --log_format, got: iso8601")


def _grpc_settings(**values) -> dict:
    req = service_pb2.LogSettingsRequest()
    for key, (kind, value) in values.items():
        setattr(req.settings[key], kind, value)
    return req.settings


def test_grpc_updates_are_read_with_tritons_rules_and_words():
    assert parse_grpc_update(_grpc_settings(log_info=("bool_param", False), log_verbose_level=("uint32_param", 7),
                                            log_format=("string_param", "default"), x=("bool_param", True))) == {
        "log_info": False, "log_verbose_level": 7, "log_format": "default"}
    assert parse_grpc_update(_grpc_settings(log_verbose_level=("uint32_param", (1 << 32) - 1))) == {
        "log_verbose_level": -1}
    assert _error(lambda: parse_grpc_update(_grpc_settings(log_file=("string_param", "")))) == (
        501, "UNIMPLEMENTED", "log file location can not be updated through network protocol")
    assert _error(lambda: parse_grpc_update(_grpc_settings(log_error=("string_param", "true")))) == (
        400, "INVALID_ARGUMENT", "expect boolean for 'log_error'")
    assert _error(lambda: parse_grpc_update(_grpc_settings(log_verbose_level=("bool_param", True)))) == (
        400, "INVALID_ARGUMENT", "expect int32 for 'log_verbose_level'")
    assert _error(lambda: parse_grpc_update(_grpc_settings(log_format=("string_param", "bad")))) == (
        400, "INVALID_ARGUMENT", "invalid argument for log_format, got: bad")
    empty = service_pb2.LogSettingsRequest()
    empty.settings["log_info"].SetInParent()  # a value with no parameter set
    assert _error(lambda: parse_grpc_update(empty.settings))[2] == "expect boolean for 'log_info'"


@pytest.fixture
def captured():
    """The root logger's one handler, writing to a buffer (a front door's stderr)."""
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
        logging.getLogger("batchyard").setLevel(logging.NOTSET)


def _emit(name: str = "batchyard.frontend") -> None:
    log = logging.getLogger(name)
    log.debug("a-debug")
    log.info("an-info")
    log.warning("a-warning")
    log.error("an-error")


def test_the_setting_switches_the_front_doors_records(captured, tmp_path):
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    logs = LogSettings(START, dir_fd)
    try:
        assert logs.settings() == {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
                                   "log_verbose_level": 0, "log_format": "default"}
        _emit()
        assert [w for w in captured.getvalue().split() if w.startswith(("a-", "an-"))] == [
            "an-info", "a-warning", "an-error"]
        logs.update({"log_info": False, "log_error": False, "log_verbose_level": 1})
        captured.truncate(0)
        captured.seek(0)
        _emit()
        assert [w for w in captured.getvalue().split() if w.startswith(("a-", "an-"))] == ["a-debug", "a-warning"]
        logs.update({"log_format": "ISO8601", "log_verbose_level": 0})
        captured.truncate(0)
        captured.seek(0)
        logging.getLogger("batchyard.frontend").warning("iso")
        stamp = captured.getvalue().split()[0]
        assert len(stamp) == 20 and stamp[10] == "T" and stamp.endswith("Z"), captured.getvalue()
    finally:
        logs.close()
        os.close(dir_fd)
    captured.truncate(0)
    captured.seek(0)
    logging.getLogger("batchyard.frontend").info("after")  # closed: the process's handlers as they were
    assert "after" in captured.getvalue()


def test_a_change_through_one_process_reaches_the_others(captured, tmp_path):
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    one, other = LogSettings(START, dir_fd), LogSettings(START, dir_fd)
    try:
        one.update({"log_warning": False, "log_verbose_level": 4})
        assert other.settings()["log_warning"] is False and other.settings()["log_verbose_level"] == 4
        other.update({"log_info": False})  # made on top of the first's change, not of its start
        assert one.settings() | {"log_file": ""} == other.settings() == {
            "log_file": "", "log_info": False, "log_warning": False, "log_error": True, "log_verbose_level": 4,
            "log_format": "default"}
        late = LogSettings(START, dir_fd)  # a front door restarted in the node's run
        assert late.settings() == one.settings()
        late.close()
    finally:
        one.close()
        other.close()
        os.close(dir_fd)


def test_a_setting_that_cannot_be_written_changes_nothing(captured, tmp_path):
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    logs = LogSettings(START, dir_fd)
    try:
        (tmp_path / "log-setting.json").mkdir()  # where the setting goes: nothing can replace it
        assert _error(lambda: logs.update({"log_info": False}))[:2] == (500, "INTERNAL")
        assert _error(logs.settings)[:2] == (500, "INTERNAL")
        logging.getLogger("batchyard.frontend").info("still")  # this process's logging as it was
        assert "still" in captured.getvalue()
    finally:
        logs.close()
        os.close(dir_fd)


def test_an_unsigned_verbose_level_past_int32_reads_back_as_tritons():
    logs = LogSettings(START, None)
    try:
        logs.update(parse_http_update({"log_verbose_level": (1 << 31) + 5}))
        assert logs.settings()["log_verbose_level"] == (1 << 64) - (1 << 31) + 5
    finally:
        logs.close()
