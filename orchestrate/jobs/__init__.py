"""Jobs by label: kill, status, logs of the caller's own jobs, and the local memory of where they ran."""
