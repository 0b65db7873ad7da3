"""Writing tiny random HF checkpoints for golden tests (torch + transformers: test-only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_random_hf_checkpoint(path: Path, config_class: Any, model_class: Any, config_dict: dict[str, Any],
                               seed: int = 0, dtype: str = "float32") -> Path:
    """Build ``model_class(config_class(**config_dict))``, randomize *every* parameter (norm
    weights and biases too, which HF initialises to ones / zeros and would hide a missing term),
    save it, and keep ``config_dict``'s own spelling in config.json (e.g. legacy rope keys)."""
    import torch

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = model_class(config_class(**{k: v for k, v in config_dict.items()
                                        if k not in ("architectures", "model_type")}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    saved = json.loads((path / "config.json").read_text())
    saved.update(config_dict)
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path


def load_hf_float32(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model
