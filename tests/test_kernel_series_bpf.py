"""The recorder's side of the kernel patch series (kernel-patches/), without the patched kernel.

- The BPF paths compiled only when the series' tracepoints or fields exist (HAVE_TP_* and HAVE_TPF_*)
  are built and loaded through the kernel's verifier against the layouts in
  kernel-patches/tracefs-formats.txt (the boot test's verbatim tracefs `format` files): BCC generates
  a tracepoint's context struct from its format file, so a child in a private mount namespace sees a
  tracefs whose events are this host's plus the series' ones, and the recorder builds its source there
  exactly as it does at run time.
- The detection of the series by `recorder.lineage()` (which then sets the kernel tag with prctl) reads
  those formats, and on a stock kernel a scope calls nothing and imports nothing more.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recorder import markers
from tests.conftest import NO_BPF, ROOT

FORMATS = ROOT / "kernel-patches" / "tracefs-formats.txt"
TRACEFS = Path("/sys/kernel/tracing")
SERIES_PROGRAMS = {  # BCC's name for each TRACEPOINT_PROBE the series enables
    "tracepoint__nvme__nvme_timeout", "tracepoint__dma__dma_map_latency", "tracepoint__io_tag__io_tag_write",
    "tracepoint__block__block_rq_complete",
}

needs_root_bpf = pytest.mark.skipif(NO_BPF is not None or shutil.which("unshare") is None,
                                    reason=NO_BPF or "needs unshare(1) for a private mount namespace")


def series_formats() -> dict[str, str]:
    """system/name -> format text, as the boot test's kernel printed them."""
    text = FORMATS.read_text()
    found = re.findall(r"^=== format (\S+) ===\n(.*?)^=== end format ===\n", text, re.M | re.S)
    assert found, f"no formats in {FORMATS}"
    return dict(found)


def fake_tracefs(tmp: Path, formats: dict[str, str]) -> Path:
    """A tracefs look-alike: this host's event formats, then the series' ones over them."""
    root = tmp / "tracefs"
    for fmt in (TRACEFS / "events").glob("*/*/format"):
        dest = root / "events" / fmt.parent.parent.name / fmt.parent.name / "format"
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            dest.write_bytes(fmt.read_bytes())
        except OSError:  # a format the kernel will not print
            dest.unlink(missing_ok=True)
    for name, text in formats.items():
        dest = root / "events" / name / "format"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    return root


# Runs as root in a private mount namespace with the fake tracefs mounted over the real one: builds the
# recorder's BPF source with its own detection of tracepoints and fields, compiles it, and loads every
# tracepoint program through the verifier (without attaching: the series' events do not exist here).
CHILD = r"""
import json, os, subprocess, sys
subprocess.run(["mount", "--bind", sys.argv[1], "/sys/kernel/tracing"], check=True)
from bcc import BPF, lib
from recorder.core import kheaders, loader
from recorder.layers import bpf_sources, definitions
from recorder.layers.cuda.apis import bpf_programs
kheaders.locate()

class CompileOnly(BPF):
    def _trace_autoload(self):
        self.loaded, self.failed = [], {}
        for i in range(lib.bpf_num_functions(self.module)):
            name = lib.bpf_function_name(self.module, i).decode()
            if name.startswith("tracepoint__"):
                try:
                    self.load_func(name, BPF.TRACEPOINT)
                    self.loaded.append(name)
                except Exception as e:
                    self.failed[name] = str(e).splitlines()[-1][:300]

p = object.__new__(loader.Probes)
p.target = loader.TargetSpec(pids=(os.getpid(),))
p.capabilities, p.layers, p.optional, p.sources = [], [], {}, bpf_sources()
p.settings = loader.Settings.from_environment()
p.definitions = definitions()
text = p._source([bpf_programs()])
out = {"defines": sorted(l.split()[1] for l in text.splitlines() if l.startswith("#define HAVE_TP")),
       "layers": p.layers}
try:
    b = CompileOnly(text=text, cflags=["-Wno-macro-redefined", "-Wno-unused-function"])
    out.update(loaded=b.loaded, failed=b.failed)
except Exception as e:
    out["error"] = str(e)[-2000:]
print("RESULT " + json.dumps(out))
"""


def build_in_namespace(tracefs: Path) -> dict:
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", CHILD,
                        str(tracefs)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"child failed (rc {r.returncode}): {r.stderr[-3000:]}"
    return {**json.loads(lines[-1][len("RESULT "):]), "stderr": r.stderr}


def test_series_formats_are_the_ones_the_recorder_reads():
    """The formats file is the current series': neutral names, io_tag where the BPF paths read it."""
    formats = series_formats()
    assert set(formats) == {"block/block_rq_complete", "nvme/nvme_timeout", "dma/dma_map_latency",
                            "io_tag/io_tag_write"}
    for name, text in formats.items():
        assert "ai" not in re.split(r"[^a-z]+", name), name
        assert text.startswith(f"name: {name.split('/')[1]}\n")
    for name in ("block/block_rq_complete", "nvme/nvme_timeout", "io_tag/io_tag_write"):
        assert re.search(r"field:u64 io_tag;\toffset:\d+;\tsize:8;", formats[name]), name


@needs_root_bpf
def test_have_tp_paths_compile_and_verify_against_the_series_formats(tmp_path):
    result = build_in_namespace(fake_tracefs(tmp_path, series_formats()))
    assert "error" not in result, result.get("error")
    for define in ("HAVE_TPF_block_block_rq_complete_io_tag", "HAVE_TP_nvme_nvme_timeout",
                   "HAVE_TP_dma_dma_map_latency", "HAVE_TP_io_tag_io_tag_write"):
        assert define in result["defines"]
    assert {"block", "mm", "dma"} <= set(result["layers"])
    assert result["failed"] == {}
    assert SERIES_PROGRAMS <= set(result["loaded"])


@needs_root_bpf
def test_a_drifted_format_breaks_the_build(tmp_path):
    """The check above can fail: the same build against an nvme_timeout without io_tag does not compile,
    and a block_rq_complete without the field compiles the stock path."""
    formats = series_formats()
    formats["nvme/nvme_timeout"] = re.sub(r"\tfield:u64 io_tag;[^\n]*\n", "", formats["nvme/nvme_timeout"])
    formats["block/block_rq_complete"] = (TRACEFS / "events/block/block_rq_complete/format").read_text()
    result = build_in_namespace(fake_tracefs(tmp_path, formats))
    assert "HAVE_TPF_block_block_rq_complete_io_tag" not in result["defines"]
    assert "Failed to compile" in result.get("error", ""), result
    assert re.search(r"no member named 'io_tag' in 'struct tracepoint__nvme__nvme_timeout'", result["stderr"]), \
        result["stderr"][-2000:]


def test_series_detection_reads_the_format_or_the_config(tmp_path):
    patched = tmp_path / "patched-format"
    patched.write_text(series_formats()["block/block_rq_complete"])
    stock = tmp_path / "stock-format"
    stock.write_text(re.sub(r"\tfield:u64 io_tag;[^\n]*\n", "", patched.read_text()))
    config_on, config_off = tmp_path / "config-on", tmp_path / "config-off"
    config_on.write_text("CONFIG_BLOCK=y\nCONFIG_BLK_IO_TAG=y\nCONFIG_NVME_CORE=y\n")
    config_off.write_text("CONFIG_BLOCK=y\n# CONFIG_BLK_IO_TAG is not set\nCONFIG_BLK_IO_TAGS=y\n")
    missing = str(tmp_path / "missing")
    assert markers.series_in_kernel((str(patched),), ())
    assert not markers.series_in_kernel((str(stock),), ())
    assert not markers.series_in_kernel((missing,), ())
    assert markers.series_in_kernel((missing,), (str(config_on),))
    assert not markers.series_in_kernel((str(stock),), (str(config_off), missing))


def test_on_a_stock_kernel_a_scope_calls_nothing(tmp_path):
    """Without the series (this host: no io_tag in block_rq_complete, no CONFIG_BLK_IO_TAG), lineage
    scopes keep working, report no kernel tag and never load ctypes for the prctl."""
    if markers.series_in_kernel():
        pytest.skip("this kernel has the I/O tag series")
    code = ("import sys, recorder\n"
            "from recorder import markers\n"
            "with recorder.lineage('a'):\n"
            "    with recorder.lineage('b'):\n"
            "        inner = markers.current_tag()\n"
            "print(inner == markers.tag_of('b'), markers.kernel_io_tags(), markers.kernel_io_tag(),"
            " 'ctypes' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False", "None", "False"]
