"""The report: its model, how it is built from the analysis, and its text, HTML and listing forms."""
