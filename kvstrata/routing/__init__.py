"""Routing a fleet: the policies (over engine views), the views the simulator reads from its schedulers
and those the router builds from engines' KV events, the engines' event log, and `kvstrata router`."""
