"""BPF C sources of the recorder, shipped as package data so an installed recorder finds them."""

from pathlib import Path

BPF_DIR = Path(__file__).resolve().parent


def source(name: str) -> str:
    """Return the text of one C source or header in this folder."""
    return (BPF_DIR / name).read_text()
