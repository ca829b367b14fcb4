"""Recording other frameworks' training runs as AxRL traces (see docs/import.md). Each module
imports its framework only when used."""
