"""The C structs rendered for BPF and their Python mirrors must agree byte for byte."""

import subprocess

from recorder.core import events


def test_c_layout_matches_python(tmp_path):
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <stdint.h>",
             "typedef uint64_t u64; typedef int64_t s64; typedef uint32_t u32; typedef int32_t s32;",
             "typedef uint16_t u16;", events.c_definitions(), "int main(void) {"]
    for layout in events.LAYOUTS:
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
    for layout in events.LAYOUTS:
        assert seen[(layout.name, "__sizeof")] == layout.size
        for name, offset in layout.offsets().items():
            assert seen[(layout.name, name)] == offset, (layout.name, name)


def test_unpadded_layout_is_refused():
    import pytest

    with pytest.raises(ValueError, match="multiple of 8"):
        events.Layout("bad", (("a", "u64"), ("b", "u32")), "not padded")


def test_the_mm_rings_records_differ_in_size():
    sizes = [layout.size for layout in events.MM_RING_LAYOUTS]
    assert len(set(sizes)) == len(sizes), {layout.name: layout.size for layout in events.MM_RING_LAYOUTS}
