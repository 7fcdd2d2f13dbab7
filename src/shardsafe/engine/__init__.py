"""Save and load engines: planning, writing, committing, reading."""
