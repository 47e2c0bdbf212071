"""The adapters room: LoRA adapters in PEFT's format, loaded for a model and applied to a step's rows by
adapter (lora.py), their files read from a path nobody vouches for (files.py). An adapter's identity enters the cache only at the root of the hash chain (its digest salts
the block hasher, kvstrata.core.hashing); nothing here touches blocks."""
