"""Runs the real engine to fit the simulator's cost model (`kvstrata calibrate`) and to check the
simulator against it (`kvstrata simulate --validate`)."""
