"""`kvstrata router`: an OpenAI proxy over engines, its routing policies and the engine views built from
KV events."""
