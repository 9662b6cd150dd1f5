"""Exports of a recording to other tools: Perfetto, Parquet, Datasette."""
