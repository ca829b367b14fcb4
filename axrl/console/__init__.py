"""What a run shows on the terminal: the progress bar and step rows (`progress`), the actors'
health table of `axrl status` and the live view (`health_table`)."""
