"""summarize.py's parts: reading the runs (runs), the headline numbers of summary.json
(headline), each file's section of SUMMARY.md (renderers) and its Markdown cells and tables
(markdown). The CLI is benchmarks/tts/summarize.py."""
