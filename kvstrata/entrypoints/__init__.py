"""What users run: the `kvstrata` command line and the OpenAI-compatible HTTP server. Nothing imports it."""
