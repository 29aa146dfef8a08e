"""The resident daemon. Only ``engine`` imports llama_cpp; ``spawn`` is light for the client."""
