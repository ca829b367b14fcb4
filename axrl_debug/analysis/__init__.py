"""Analysis over AxRL traces, free of any CLI code: mismatch metrics and breakdowns, per-step
tables, spike detection and attribution, run diffs and the golden-file gate. The commands in
``axrl_debug/commands`` are thin wrappers that format these results."""
