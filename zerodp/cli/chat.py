"""`zerodp generate --chat MESSAGE`: a user message rendered with the chat template the run's data was
prepared with (add_generation_prompt, as transformers' apply_chat_template renders it), the answer sampled
until the template's end-of-turn token (or --max-new-tokens), and only the answer printed.

The template: the one the checkpoint records (a run on a `zerodp prepare --chat` folder, or a zerodp
export of one: zerodp.data.chat.chat_record), else the chat_template of the tokenizer_config.json beside a
Hugging Face folder, or beside the base a PEFT folder names (its generation_config.json's eos_token_id,
else the template's end of turn, stops).
"""

from __future__ import annotations

import json
from pathlib import Path

from zerodp.errors import UserError


def chat_template_of(source, tokenizer):
    """(ChatTemplate, end-of-turn id or None) for an open checkpoint; UserError when it has no template."""
    from zerodp.data.chat import compile_template, end_of_turn, load_template

    rec = (source.meta.get("tokenizer") or {}).get("chat")
    if rec:
        tpl = compile_template(rec["template"], f"{source.path}'s recorded chat template", rec.get("specials") or {})
        eot = rec.get("end_of_turn_id")
        return tpl, eot if eot is not None else end_of_turn(tpl, tokenizer)[1]
    from zerodp.convert.lora_source import model_folders

    for folder in model_folders(source):  # beside the checkpoint, or beside a LoRA model's base
        config = folder / "tokenizer_config.json"
        if config.is_file() and "chat_template" in config.read_text(encoding="utf-8"):
            tpl = load_template(folder / "tokenizer.json", None)
            eot = _generation_eos(folder / "generation_config.json")
            return tpl, eot if eot is not None else end_of_turn(tpl, tokenizer)[1]
    raise UserError(f"{source.path} records no chat template (it was not trained on data of zerodp prepare --chat, "
                    f"and no tokenizer_config.json beside it holds one); use --prompt, or train on chat data")


def _generation_eos(file: Path) -> int | None:
    try:
        eos = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return eos if isinstance(eos, int) else None


def run_chat(args) -> int:
    """Print the answer to args.chat (see the module docstring)."""
    import torch

    from zerodp.api import model_from_source
    from zerodp.cli.use import _autocast, _device, _run_config, text_of
    from zerodp.convert.lora_source import open_model
    from zerodp.models.common import KVCache
    from zerodp.trainer.sample import next_logits, next_token

    if args.prompt is not None:
        raise UserError("--chat and --prompt are two prompts; give one (--chat renders a user message with the "
                        "chat template, --prompt continues raw text)")
    device = _device(args.device)
    with open_model(args.path) as source:
        run_cfg = _run_config(source)
        text = text_of(source, run_cfg, args.tokenizer)
        if text.tokenizer is None:
            raise UserError(f"{args.path}: no tokenizer to encode the message with"
                            + (f" ({text.note})" if text.note else "") + "; pass --tokenizer path/to/tokenizer.json")
        tpl, eot = chat_template_of(source, text.tokenizer)
        model = model_from_source(source, device)
    rendered = tpl.render([{"role": "user", "content": args.chat}], add_generation_prompt=True)
    prompt = text.tokenizer.encode(rendered, add_special_tokens=False).ids
    if max(prompt, default=0) >= model.arch.vocab_size:
        raise UserError(f"the message encodes to token id {max(prompt)}, beyond the model's vocabulary of "
                        f"{model.arch.vocab_size}; use the tokenizer the model was trained with (--tokenizer)")
    seed = args.seed if args.seed is not None else int((run_cfg.get("train") or {}).get("seed", 0))
    generator = torch.Generator().manual_seed(seed)
    idx, answer = torch.tensor([prompt], dtype=torch.long), []  # (1, T) on the CPU
    kv = KVCache(model.arch.n_layer)
    with torch.no_grad(), _autocast(device, args.precision):
        for _ in range(args.max_new_tokens):
            logits, kv = next_logits(model, idx, kv, model.arch.block_size, device)
            token = next_token(logits[:, -1, :], generator, args.temperature, args.top_k)
            if eot is not None and int(token) == eot:
                break  # the end of the answer
            answer.append(int(token))
            idx = torch.cat([idx, token], dim=1)
    print(text.tokenizer.decode(answer, skip_special_tokens=False))
    return 0
