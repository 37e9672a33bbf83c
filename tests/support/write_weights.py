"""Random weights for a tiny model directory, run with vLLM's own interpreter.

``python write_weights.py DIR`` reads ``DIR/config.json`` (written by
:mod:`tests.support.real_models`), builds the model from it with the transformers that
vLLM runs, and saves it as safetensors. The weights are random: outputs are gibberish,
which is all a KV-capacity test needs. Nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(directory: Path) -> None:
    import torch  # type: ignore[import-not-found]  # only where real vLLM nodes run
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    # Small weights keep activations finite through a few random layers.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    saved = json.loads((directory / "config.json").read_text())
    print(json.dumps({"architectures": saved.get("architectures")}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
