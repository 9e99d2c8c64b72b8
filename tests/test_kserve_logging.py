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
        "log_verbose_level": 0}
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
    logging.getLogger("batchyard.frontend").debug("no-debug")
    assert "after" in captured.getvalue() and "no-debug" not in captured.getvalue()
    assert captured.getvalue()[10] == " "  # the handler's own timestamps again, not ISO 8601's


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


def test_a_verbose_level_past_int32_reads_back_as_tritons():
    # Triton keeps the low 32 bits as an int32, and a negative one as 0 (2**31 + 5 read back as
    # 2**64 - 2**31 + 5 here)
    logs = LogSettings(START, None)
    try:
        for asked, kept in [((1 << 32) + 3, 3), ((1 << 31) + 5, 0), ((1 << 64) - 1, 0), ((1 << 31) - 1, (1 << 31) - 1)]:
            logs.update(parse_http_update({"log_verbose_level": asked}))
            assert logs.settings()["log_verbose_level"] == kept, asked
        assert parse_grpc_update(_grpc_settings(log_verbose_level=("uint32_param", (1 << 31) + 5))) == {
            "log_verbose_level": 0}
    finally:
        logs.close()


@pytest.mark.parametrize("planted", ["null", '{"log_info": true}', "not json", "fifo", "link", "folder"])
def test_a_setting_file_no_front_door_wrote_is_refused_and_the_next_update_replaces_it(captured, tmp_path, planted):
    # A file of another shape (null) raised TypeError: it stopped each front door's 1 s sweep for
    # good, answered the settings calls 400, and a restarted front door exited at its start (up
    # restarted it for ever). A FIFO held the loop in open(); a link could not be replaced.
    path = tmp_path / "log-setting.json"
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "link":
        path.symlink_to(tmp_path / "elsewhere")
    elif planted == "folder":
        path.mkdir()
    else:
        path.write_text(planted)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    logs = LogSettings(START, dir_fd)  # a front door (re)started beside it: the start setting
    try:
        status, code, message = _error(logs.settings)
        assert (status, code) == (500, "INTERNAL") and "the node's log setting cannot be read" in message
        logging.getLogger("batchyard.frontend").info("served")
        assert "served" in captured.getvalue()
        if planted == "folder":  # (nothing can replace a folder: the update says so)
            assert _error(lambda: logs.update({"log_info": False}))[:2] == (500, "INTERNAL")
            return
        logs.update({"log_info": False})  # ...replaces it whole
        assert logs.settings()["log_info"] is False and path.is_file() and not path.is_symlink()
        assert not (tmp_path / "elsewhere").exists()
    finally:
        logs.close()
        os.close(dir_fd)


def test_a_setting_file_removed_is_the_start_setting_in_every_process(captured, tmp_path):
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    one, other = LogSettings(START, dir_fd), LogSettings(START, dir_fd)
    try:
        one.update({"log_info": False})
        assert other.settings()["log_info"] is False
        (tmp_path / "log-setting.json").unlink()
        assert one.settings()["log_info"] is True and one.settings() == other.settings()
    finally:
        one.close()
        other.close()
        os.close(dir_fd)
