"""Run code inside the Hugging Face test virtual environment (torch + transformers), as a subprocess.

The package never imports torch or transformers. The preset tests make tiny random models with
``transformers`` in that venv (created once by ``scripts/hf_env.sh`` in a cache folder outside the
checkout), convert them with reshard's CLI, and load reshard's output back with ``from_pretrained``.
Scripts receive JSON on argv[1] and print JSON on the last line of stdout (as ``tests/oracle.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.subvenv import run_script, venv_python

ROOT = Path(__file__).resolve().parent.parent
ENV_SCRIPT = ROOT / "scripts" / "hf_env.sh"

PRELUDE = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import numpy as np
import torch
import transformers
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
ARGS = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
def out(obj):
    print("\\n@@HF@@" + json.dumps(obj))
"""


def hf_python() -> str:
    """Path of the Hugging Face venv's python, creating the venv on first use (a few minutes)."""
    return venv_python(ENV_SCRIPT)


def run_hf(code: str, args: Any = None, timeout: float = 600) -> Any:
    """Run ``code`` (with PRELUDE: torch, transformers, np, ARGS, out()) in the hf venv; return what it out()s."""
    return run_script(hf_python(), PRELUDE, "@@HF@@", code, args, timeout=timeout, env={"HF_HUB_OFFLINE": "1"})


# Tiny random models of the preset families, saved with save_pretrained (safetensors), and their logits.
MAKE_MODEL = """
classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "qwen3_moe": transformers.Qwen3MoeConfig, "deepseek_v3": transformers.DeepseekV3Config}
for spec in ARGS["models"]:
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    common.update(spec.get("config", {}))
    config = classes[spec["kind"]](**common)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():  # every tensor distinct, norms too, so a mix-up changes the logits
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(spec["folder"], safe_serialization=True)
    ids = torch.arange(24).reshape(2, 12) % config.vocab_size
    with torch.no_grad():
        logits = model(ids).logits
    np.save(os.path.join(spec["folder"], "logits.npy"), logits.numpy())
out({"made": len(ARGS["models"])})
"""


def make_models(run, specs: dict[str, tuple[str, dict[str, Any]]], root: Path) -> dict[str, Path]:
    """Tiny random models (name -> (transformers family, config overrides)) saved under ``root``, in one process."""
    folders = {name: root / name.replace(".", "_") for name in specs}
    models = [{"kind": kind, "folder": str(folders[name]), "config": cfg} for name, (kind, cfg) in specs.items()]
    run(MAKE_MODEL, {"models": models})
    return folders


# from_pretrained on folders; their logits compared with saved arrays (exactly). ARGS: {"loads": [{folder, logits}]}.
LOAD_MODEL = """
results = []
for load in ARGS["loads"]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        load["folder"], torch_dtype=torch.float32, output_loading_info=True)
    model.eval()
    ids = torch.arange(24).reshape(2, 12) % model.config.vocab_size
    with torch.no_grad():
        logits = model(ids).logits
    want = torch.from_numpy(np.load(load["logits"]))
    results.append({"equal": bool(torch.equal(logits, want)), "max_diff": float((logits - want).abs().max()),
                    "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                    "mismatched": [str(m) for m in info.get("mismatched_keys", [])]})
out(results)
"""


def load_models(run, loads: list[tuple[Path, Path]]) -> list[dict[str, Any]]:
    """``from_pretrained`` on each (folder, logits.npy), in one process: loading info, logits equal or not."""
    return run(LOAD_MODEL, {"loads": [{"folder": str(f), "logits": str(lg)} for f, lg in loads]})
