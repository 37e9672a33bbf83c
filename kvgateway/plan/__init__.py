"""Plan: from a client's request bytes to what it needs (model, counted prompt, output
budget, the demand admission reserves) and the body the node receives. No I/O but the
injected node-count call."""
