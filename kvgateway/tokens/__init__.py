"""Token counting: tiktoken encodings that load offline, and prompt counting."""
