"""`axrl-debug tui RUN`: a Textual terminal UI over a run's trace — steps, the samples of a step,
the tokens of a sample coloured by training–inference mismatch (docs/tui.md).

Import ``DebugApp`` / ``run_tui`` from ``axrl_debug.tui.app``; this package's ``__init__`` stays
free of textual so that ``axrl_debug.tui.data`` can be used without it."""
