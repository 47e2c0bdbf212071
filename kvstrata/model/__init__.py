"""The model path: loading weights and tokenizer, the Llama-family decoder, paged attention."""
