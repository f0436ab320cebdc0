"""`dualpath model write`: a Llama-format checkpoint both engines load (DualPath's and vLLM).

The weights are the DualPath engine's seeded ones (`Transformer.from_seed`), written with the
engine's `save_checkpoint` (config.json + model.safetensors) and the project's Hugging Face
tokenizer (`save_hf_tokenizer`), plus what vLLM's loader reads that the engine does not need
(special token ids, the context length). Point `spec.model.checkpointPath` at the directory and
both engines serve the same weights, so their answers can be compared prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from dualpath import config
from dualpath.config import ModelSpec

log = logging.getLogger(__name__)

# Longest context vLLM may schedule on the written model (its max_model_len default).
MAX_POSITIONS = 32768


def write_checkpoint(spec: ModelSpec, out: str | Path) -> Path:
    """Write `spec`'s seeded weights and tokenizer as a checkpoint directory; returns it."""
    from dualpath.engine.checkpoint import save_checkpoint
    from dualpath.engine.model import Transformer
    from dualpath.frontend.tokenizer import BOS, EOS, PAD, save_hf_tokenizer

    if spec.attention != "gqa":
        raise ValueError("model.attention: only gqa models are written as Llama checkpoints")
    out = Path(out)
    save_checkpoint(Transformer.from_seed(spec), out)
    cfg_file = out / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_position_embeddings=MAX_POSITIONS,
        hidden_act="silu",
        _name_or_path=spec.name,
    )
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    # the tokenizer of a spec without a checkpoint: the byte tokenizer in HF format
    save_hf_tokenizer(spec.model_copy(update={"checkpoint_path": None}), out)
    log.info("checkpoint of %s (%d layers) written to %s", spec.name, spec.layers, out)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    w = sub.add_parser("write", help="write the config's model (seeded weights) as a checkpoint")
    w.add_argument("-f", "--file", help="DualPathCluster YAML (default: embedded local)")
    w.add_argument("--preset", help="a model preset instead of the config's model (e.g. tiny64)")
    w.add_argument("--out", required=True, help="checkpoint directory to write")


def run(args: argparse.Namespace) -> int:
    if args.preset:
        spec = ModelSpec(preset=args.preset)
    else:
        spec = config.load_or_default(args.file).spec.model.model_copy(
            update={"checkpoint_path": None}
        )
    out = write_checkpoint(spec, args.out)
    print(f"wrote {spec.name} to {out} (set spec.model.checkpointPath: {out.resolve()})")
    return 0
