"""Settings: every STALL_RECORDER_* variable through one model, one-line errors that name the
variable, and commands that read only what they use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ROOT, run_recorder

from recorder.core.settings import Settings
from recorder.layers.gpu import GpuSettings
from store.errors import UserError


def test_defaults_of_an_empty_environment() -> None:
    s = Settings.from_environment({})
    assert s == Settings()
    assert (s.db, s.mcp_token, s.nvml_lib, s.gpu_interval_ms) == (Path("stall.db"), None, None, 100)
    assert s.offcpu_stacks is True and s.bcc_rings is False and s.dlopen_hold is True
    assert s.gpu_interval_s == 0.1


def test_every_field_is_read_from_its_variable(tmp_path: Path) -> None:
    lib = tmp_path / "libnvidia-ml.so.1"
    lib.write_bytes(b"")
    s = Settings.from_environment({
        "STALL_RECORDER_DB": "/var/tmp/run.db", "STALL_RECORDER_MCP_TOKEN": "t0k",
        "STALL_RECORDER_NVML_LIB": str(lib), "STALL_RECORDER_GPU_INTERVAL_MS": " 250 ",
        "STALL_RECORDER_OFFCPU_STACKS": "Off", "STALL_RECORDER_BCC_RINGS": "1",
        "STALL_RECORDER_DLOPEN_HOLD": "no", "STALL_RECORDER_UNKNOWN": "ignored",
    })
    assert s.db == Path("/var/tmp/run.db") and s.mcp_token == "t0k" and s.nvml_lib == lib
    assert s.gpu_interval_ms == 250 and s.offcpu_stacks is False and s.bcc_rings is True
    assert s.dlopen_hold is False
    # empty values mean "not set", as before
    assert Settings.from_environment({"STALL_RECORDER_DB": "", "STALL_RECORDER_MCP_TOKEN": ""}) == Settings()
    # only "1" switches the ring reader; anything but an explicit off keeps the stacks
    assert Settings.from_environment({"STALL_RECORDER_BCC_RINGS": "yes"}).bcc_rings is False
    assert Settings.from_environment({"STALL_RECORDER_OFFCPU_STACKS": "maybe"}).offcpu_stacks is True


@pytest.mark.parametrize("value", ["5", "60001", "-1", "1.5", "abc"])
def test_bad_gpu_interval_is_one_line_naming_the_variable(value: str) -> None:
    with pytest.raises(UserError) as e:
        Settings.from_environment({"STALL_RECORDER_GPU_INTERVAL_MS": value})
    assert str(e.value) == (f"STALL_RECORDER_GPU_INTERVAL_MS={value}: give whole milliseconds from 10 to 60000, "
                            "or 0 for no GPU sampling")


def test_launch_stack_settings() -> None:
    s = Settings.from_environment({})
    assert (s.launch_stack_min_us, s.launch_stack_sample, s.keep_runtime_launches) == (100, 64, False)
    s = Settings.from_environment({"STALL_RECORDER_LAUNCH_STACK_MIN_US": "0", "STALL_RECORDER_LAUNCH_STACK_SAMPLE": "1",
                                   "STALL_RECORDER_KEEP_RUNTIME_LAUNCHES": "on"})
    assert (s.launch_stack_min_us, s.launch_stack_sample, s.keep_runtime_launches) == (0, 1, True)
    assert Settings.from_environment({"STALL_RECORDER_KEEP_RUNTIME_LAUNCHES": "maybe"}).keep_runtime_launches is False


def test_map_ring_and_age_settings() -> None:
    s = Settings.from_environment({})
    assert (s.block_inflight, s.block_ring_pages, s.inflight_max_age_s) == (16384, 256, 120)
    s = Settings.from_environment({"STALL_RECORDER_BLOCK_INFLIGHT": "64", "STALL_RECORDER_BLOCK_RING_PAGES": " 1 ",
                                   "STALL_RECORDER_INFLIGHT_MAX_AGE_S": "5"})
    assert (s.block_inflight, s.block_ring_pages, s.inflight_max_age_s) == (64, 1, 5)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("BLOCK_INFLIGHT", "10", "give a whole number from 64 to 1048576, or unset it for 16384"),
    ("BLOCK_INFLIGHT", "lots", "give a whole number from 64 to 1048576, or unset it for 16384"),
    ("BLOCK_RING_PAGES", "3", "give a power of two from 1 to 65536, or unset it for 256"),
    ("BLOCK_RING_PAGES", "131072", "give a power of two from 1 to 65536, or unset it for 256"),
    ("INFLIGHT_MAX_AGE_S", "1", "give a whole number from 5 to 86400, or unset it for 120"),
    ("LAUNCH_STACK_MIN_US", "-5", "give a whole number from 0 to 10000000, or unset it for 100"),
    ("LAUNCH_STACK_SAMPLE", "3", "give a power of two from 1 to 65536, or unset it for 64"),
    ("LAUNCH_STACK_SAMPLE", "0", "give a power of two from 1 to 65536, or unset it for 64"),
])
def test_bad_map_ring_or_age_is_one_line_naming_the_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(UserError) as e:
        Settings.from_environment({f"STALL_RECORDER_{name}": value})
    assert str(e.value) == f"STALL_RECORDER_{name}={value}: {message}"


def test_missing_nvml_library_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing.so"
    with pytest.raises(UserError) as e:
        Settings.from_environment({"STALL_RECORDER_NVML_LIB": str(missing)})
    assert str(e.value) == (f"STALL_RECORDER_NVML_LIB={missing}: no such file: point it at a libnvidia-ml.so.1 "
                            "or unset it")
    # GpuSettings reads the same fields through the same model
    with pytest.raises(UserError, match="STALL_RECORDER_NVML_LIB"):
        GpuSettings.from_environment({"STALL_RECORDER_NVML_LIB": str(missing)})


def test_only_reads_the_named_fields() -> None:
    bad = {"STALL_RECORDER_GPU_INTERVAL_MS": "5", "STALL_RECORDER_DB": "x.db"}
    assert Settings.from_environment(bad, only=("db",)).db == Path("x.db")
    with pytest.raises(UserError):
        Settings.from_environment(bad)


def test_cli_default_database_comes_from_the_setting() -> None:
    """`--db` defaults to $STALL_RECORDER_DB, and a malformed recording setting does not stop a
    command that does not record."""
    name = "recording_named_by_env.db"
    env = {**os.environ, "STALL_RECORDER_DB": name, "STALL_RECORDER_GPU_INTERVAL_MS": "5", "COLUMNS": "200"}
    help_text = run_recorder("steps", "--help", env=env, check=True).stdout
    assert f"default {name}" in help_text
    result = run_recorder("steps", env=env)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and name in result.stderr, result.stderr
    assert not (ROOT / name).exists()


def test_the_https_server_names_the_token_setting() -> None:
    """mcp_server does not import the recorder: the command line reads the token setting and hands
    it over, and the server's messages name the same variable."""
    from mcp_server.https import TOKEN_ENV, read_token

    assert TOKEN_ENV == Settings.variable("mcp_token")
    assert read_token(None, "from-the-environment") == "from-the-environment"
