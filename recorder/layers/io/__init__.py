"""The I/O layer: block requests, memory pressure, TCP retransmits, DMA (layer.py) and the block
devices they name (devices.py)."""
