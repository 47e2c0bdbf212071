"""The `kvstrata` commands: generate, serve, router, simulate, calibrate, bench."""
