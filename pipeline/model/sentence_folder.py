"""What a sentence-transformers folder says about computing its answers, read as sentence-transformers
reads it: the pooling mode and Normalize (modules.json, 1_Pooling/config.json), the prompts
(config_sentence_transformers.json), the length (sentence_bert_config.json, tokenizer_config.json);
and what any text folder's tokenizer says about padding (tokenizer_config.json, tokenizer.json), as
transformers' AutoTokenizer reads it.

A folder without modules.json is a bare transformers encoder: mean pooling + L2, right padding.
Anything that would change the answer and is not computed here is refused by name, never ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from handlers.pooling import MODES
from pipeline.model.weights import CheckpointError

# Module types served as the folder defines them; any other (Dense, LayerNorm, ...) is refused.
KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass
class SentenceFolder:
    pooling: str = "mean"
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: Optional[str] = None
    max_seq_length: Optional[int] = None        # the folder's own limit, None when it names none
    include_prompt: bool = True                 # false: the prompt's tokens are left out of the pooling

    def as_task(self) -> dict:
        """The fields the serving handler computes with (variant.json's task)."""
        task = {"pooling": self.pooling, "normalize": self.normalize, "prompts": dict(self.prompts),
                "default_prompt_name": self.default_prompt_name}
        return task if self.include_prompt else {**task, "include_prompt": False}


def _json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); restore the file from the model's publisher") from None


def pooling_of(cfg_file: Path) -> tuple[str, bool]:
    """The one pooling mode 1_Pooling/config.json switches on, and whether the prompt's tokens are pooled."""
    cfg = _json(cfg_file)
    on = [key for key, value in cfg.items() if key.startswith("pooling_mode_") and value is True]
    unknown = [key for key in on if key not in MODES]
    supported = ", ".join(f"{key} ({name})" for key, (name, _) in MODES.items())
    if unknown:
        raise CheckpointError(f"{cfg_file}: pooling mode {', '.join(unknown)} is not supported; supported: {supported}")
    if len(on) != 1:
        raise CheckpointError(f"{cfg_file}: exactly one pooling mode must be true, found "
                              f"{', '.join(on) if on else 'none'}; supported: {supported}")
    include_prompt = cfg.get("include_prompt", True)
    if not isinstance(include_prompt, bool):
        raise CheckpointError(f"{cfg_file}: include_prompt is {include_prompt!r}; expected true or false")
    return MODES[on[0]][0], include_prompt


def read_sentence_folder(folder: Path) -> SentenceFolder:
    """The folder's sentence-transformers modules and settings (its tokenizer: tokenizer_settings)."""
    out = SentenceFolder()
    modules_file = folder / "modules.json"
    if modules_file.is_file():
        out.normalize = False
        for m in _json(modules_file):
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            if kind not in KNOWN_MODULES:
                raise CheckpointError(f"{modules_file}: module {m.get('type')!r} ({m.get('path')}) is not served; "
                                      f"served: {', '.join(KNOWN_MODULES)}")
            if kind == "Normalize":
                out.normalize = True
            elif kind == "Pooling":
                cfg_file = folder / m.get("path", "") / "config.json"
                if not cfg_file.is_file():
                    raise CheckpointError(f"{cfg_file} is missing: modules.json names a Pooling module there")
                out.pooling, out.include_prompt = pooling_of(cfg_file)
    st_config = folder / "config_sentence_transformers.json"
    if st_config.is_file():
        cfg = _json(st_config)
        out.prompts = {str(k): str(v) for k, v in (cfg.get("prompts") or {}).items()}
        out.default_prompt_name = cfg.get("default_prompt_name") or None
        if out.default_prompt_name is not None and out.default_prompt_name not in out.prompts:
            raise CheckpointError(f"{st_config}: default_prompt_name {out.default_prompt_name!r} is not one of its "
                                  f"prompts ({', '.join(out.prompts) or 'none'})")
    bert_config = folder / "sentence_bert_config.json"
    tok_config = folder / "tokenizer_config.json"
    tok = _json(tok_config) if tok_config.is_file() else {}
    if bert_config.is_file():
        out.max_seq_length = _positive(_json(bert_config).get("max_seq_length"))
    if out.max_seq_length is None:
        # transformers' "no limit" placeholder is 1e30: not a limit.
        limit = _positive(tok.get("model_max_length"))
        out.max_seq_length = limit if limit is not None and limit < 10 ** 9 else None
    return out


def _positive(value) -> Optional[int]:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1 else None


def _tokenizer_json_side(folder: Path) -> Optional[str]:
    path = folder / "tokenizer.json"
    padding = (_json(path).get("padding") or {}) if path.is_file() else {}
    direction = padding.get("direction")
    return str(direction).lower() if direction else None


def pad_id_of(tokenizer_file: Path, pad_token: Optional[str]) -> Optional[int]:
    """The id of the folder's pad token (tokenizer_config.json), else tokenizer.json's padding's;
    None leaves the serving handler's guess ([PAD], <pad>, 0). Qwen-style vocabularies pad with
    their end-of-text token at the vocabulary's end, not 0."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_file))
    if pad_token is not None:
        pad_id = tok.token_to_id(pad_token)
        if pad_id is None:
            raise CheckpointError(f"{tokenizer_file.parent / 'tokenizer_config.json'}: pad_token {pad_token!r} is not "
                                  f"in {tokenizer_file.name}'s vocabulary")
        return int(pad_id)
    padding = tok.padding or {}
    return int(padding["pad_id"]) if "pad_id" in padding else None


def tokenizer_settings(folder: Path) -> dict:
    """The padding side and pad id a folder's tokenizer defines (the text tasks with a head)."""
    tok_config = folder / "tokenizer_config.json"
    tok = _json(tok_config) if tok_config.is_file() else {}
    side = str(tok.get("padding_side") or _tokenizer_json_side(folder) or "right")
    if side not in ("left", "right"):
        raise CheckpointError(f"{tok_config}: padding_side {side!r}; expected 'left' or 'right'")
    pad = tok.get("pad_token")
    return {"padding_side": side, "pad_id": pad_id_of(folder / "tokenizer.json", pad.get("content") if isinstance(pad, dict) else pad)}
