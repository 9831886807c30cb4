"""Lab tools: measurements behind findings written in the docs, kept runnable (``python -m bench.lab.<tool>``) for
re-checking those findings or A/B-testing a change; not part of ``tierline bench``. See README.md here."""
