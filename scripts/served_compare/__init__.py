"""The served-vs-transformers check (scripts/served_vs_transformers.py is its command line): seeded
requests per task (cases), the transformers references (references), the per-answer comparison
(judging), the report (summary), and the run that builds, serves and asks (harness)."""
