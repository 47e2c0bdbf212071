"""The simulator: traces replayed through the real scheduler and tier manager on a virtual clock,
its cost model and calibration, validation against the engine, and the simulate / calibrate commands."""
