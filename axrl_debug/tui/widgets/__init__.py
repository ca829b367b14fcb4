"""The TUI's widgets, one job each: tables of steps and samples, metric sparklines, the token
text and the token detail panel."""
