"""The C structs rendered for BPF and their Python mirrors must agree byte for byte."""

import subprocess

import pytest

from recorder.core import events
from recorder.layers import LAYERS, definitions
from recorder.layers.io.records import MM_RING_LAYOUTS


def test_c_layout_matches_python(tmp_path):
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <stdint.h>",
             "typedef uint64_t u64; typedef int64_t s64; typedef uint32_t u32; typedef int32_t s32;",
             "typedef uint16_t u16;", definitions().c_text(), "int main(void) {"]
    for layout in definitions().layouts:
        lines.append(f'printf("{layout.name} __sizeof %zu\\n", sizeof(struct {layout.name}));')
        for name in layout.names:
            lines.append(f'printf("{layout.name} {name} %zu\\n", offsetof(struct {layout.name}, {name}));')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    subprocess.run(["gcc", "-o", str(tmp_path / "layout"), str(src)], check=True)
    out = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout
    seen = {}
    for line in out.splitlines():
        struct, field, value = line.split()
        seen[(struct, field)] = int(value)
    for layout in definitions().layouts:
        assert seen[(layout.name, "__sizeof")] == layout.size
        for name, offset in layout.offsets().items():
            assert seen[(layout.name, name)] == offset, (layout.name, name)


def test_unpadded_layout_is_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        events.Layout("bad", (("a", "u64"), ("b", "u32")), "not padded")


def test_the_mm_rings_records_differ_in_size():
    sizes = [layout.size for layout in MM_RING_LAYOUTS]
    assert len(set(sizes)) == len(sizes), {layout.name: layout.size for layout in MM_RING_LAYOUTS}


def test_the_layers_records_are_numbered_and_checked_when_gathered():
    d = definitions()
    # every drop counter has its index, in registry order, and the count sizes the BPF array
    indices = [d.constants[c] for layer in LAYERS for c, _ in layer.records.drops]
    assert indices == list(range(d.constants["PROBE_COUNT"]))
    assert len(d.probe_names) == d.constants["PROBE_COUNT"] == len(set(d.probe_names))
    a = events.Records(constants={"X_ONE": 1})
    with pytest.raises(ValueError, match="X_ONE is defined twice"):
        events.Definitions.gather([a, a])
