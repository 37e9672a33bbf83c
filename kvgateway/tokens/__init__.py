"""Token counting; imports nothing above it (config, core, upstream, server).

- ``encoding``: tiktoken encodings that load offline (the cl100k stand-in), and the
  cache of loaded encodings and model tokenizers;
- ``counting``: the stand-in's count of a request (text pieces, template allowances);
- ``modeldir``, ``bytelevel``, ``engines``: a model's own tokenizer directory, run by
  tiktoken where provably exact, else by ``tokenizers``;
- ``chat_template``, ``exact``: a chat rendered with the model's template and counted
  as the node counts it;
- ``standin``: an upper bound on the node's count from the stand-in's;
- ``prompt_estimate``: what admission reserves (exact, or the bound);
- ``node_count``: the node's own count, from /tokenize or its context-length 400.
"""
