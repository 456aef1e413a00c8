"""Conversations -> token ids and a loss mask, rendered with the tokenizer's own chat template exactly as
transformers' `apply_chat_template(conversation, tokenize=True)` renders and encodes them. No torch, no
transformers: jinja2 and the tokenizers library.

Rendering (transformers/utils/chat_template_utils.py, _cached_compile_jinja_template and
render_jinja_template): an ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the
loopcontrols extension and a `{% generation %}` block tag (rendered as its body), a `tojson` filter that
is json.dumps(ensure_ascii=False), the globals raise_exception (a TemplateError), strftime_now, dict and
namespace; rendered with messages, tools=None, documents=None, add_generation_prompt=False and the
tokenizer's named special tokens (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token,
mask_token: tokenization_utils_base.py, special_tokens_map and apply_chat_template's template_kwargs).
The ids are `encode(rendered, add_special_tokens=False)`, as apply_chat_template's tokenize=True does.

The mask (1 = a target of the loss). An assistant turn's text is what rendering messages[:i+1] adds to
rendering messages[:i]; its target span runs from its content's first character to the end of that text,
trailing whitespace left out: the content and its end-of-turn token (ChatML's `<|im_end|>`, Llama 3's
`<|eot_id|>`), not the newline the template writes after it. A token is a target iff its characters
(the tokenizer's offsets) overlap a span, as transformers' assistant_masks marks them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from zerodp.errors import UserError

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TRAIN_ON = ("assistant", "last", "all")


class NotAConversation(ValueError):
    """A row that holds no conversation (counted, not fatal)."""


class Refused(ValueError):
    """A conversation the template refuses (its raise_exception, or another template error; counted)."""


@dataclass
class ChatTemplate:
    source: str  # where the template came from
    text: str
    specials: dict  # bos_token, eos_token, ... as the template sees them
    template: object = None  # the compiled jinja2 Template

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.specials)
        except jinja2.TemplateError as e:
            raise Refused(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def compile_template(text: str, source: str, specials: dict) -> ChatTemplate:
    """The template `text` compiled as transformers compiles it (see the module docstring)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):  # `{% generation %}...{% endgeneration %}`: its body, unmarked
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):  # no underscore attributes, as transformers' TemplateNamespace
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    try:
        template = env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"the chat template of {source} is not valid Jinja (line {e.lineno}: {e.message}); "
                        f"fix it or give another with --chat-template FILE") from None
    return ChatTemplate(source, text, specials, template)


def _token_text(value) -> str | None:
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def load_template(tokenizer_file: Path, given: str | None) -> ChatTemplate:
    """The chat template: `given` (a Jinja file, or a tokenizer_config.json), else the chat_template.jinja
    beside tokenizer_file, else the chat_template of the tokenizer_config.json beside it (transformers'
    order: tokenization_utils_base.py, from_pretrained's chat_template_file). The special-token variables
    come from that tokenizer_config.json."""
    config_file = tokenizer_file.with_name("tokenizer_config.json")
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except ValueError as e:
            raise UserError(f"{config_file} is not JSON ({e}); fix it or remove it") from None
        config = config if isinstance(config, dict) else {}
    specials = {k: t for k in SPECIAL_NAMES if (t := _token_text(config.get(k))) is not None}
    how = ("give one with --chat-template FILE (a Jinja file), or put the model's tokenizer_config.json (with its "
           "chat_template) or chat_template.jinja beside the tokenizer.json")
    if given is not None:
        p = Path(given)
        if not p.is_file():
            raise UserError(f"--chat-template {given} not found; {how}")
        text = p.read_text(encoding="utf-8")
        if p.suffix == ".json":
            try:
                text = _config_template(json.loads(text))
            except ValueError:
                text = None
            if text is None:
                raise UserError(f"--chat-template {given} is JSON without a chat_template string; {how}")
        return compile_template(text, str(p), specials)
    jinja = tokenizer_file.with_name("chat_template.jinja")
    if jinja.is_file():
        return compile_template(jinja.read_text(encoding="utf-8"), str(jinja), specials)
    text = _config_template(config)
    if text is None:
        where = config_file if config_file.is_file() else tokenizer_file.parent
        raise UserError(f"no chat template for {tokenizer_file} ({where} has none); {how}")
    return compile_template(text, str(config_file), specials)


def _config_template(config) -> str | None:
    t = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(t, list):  # named templates: the default one
        t = next((e.get("template") for e in t if isinstance(e, dict) and e.get("name") == "default"), None)
    return t if isinstance(t, str) else None


def conversation(row, messages_field: str, prompt_field: str, response_field: str) -> list[dict]:
    """The messages of a row: its `messages_field` list of {role, content}, or a user prompt and an
    assistant response. NotAConversation for anything else."""
    if not isinstance(row, dict):
        raise NotAConversation(f"a {type(row).__name__}, not an object")
    if row.get(messages_field) is not None:
        msgs = row[messages_field]
        if not isinstance(msgs, list) or not msgs:
            raise NotAConversation(f"{messages_field!r} is not a non-empty list")
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise NotAConversation(f"a message of {messages_field!r} lacks a role or content string")
        return [{k: v for k, v in m.items() if v is not None} for m in msgs]  # as _normalize_chat_messages
    prompt, response = row.get(prompt_field), row.get(response_field)
    if isinstance(prompt, str) and isinstance(response, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    raise NotAConversation(f"no {messages_field!r} list and no {prompt_field!r}/{response_field!r} strings")


def target_spans(tpl: ChatTemplate, messages: list[dict], rendered: str, train_on: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of `rendered` (the whole conversation) that are targets."""
    if train_on == "all":
        return [(0, len(rendered))]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last":
        turns = turns[-1:]
    spans = []
    for i in turns:
        before = tpl.render(messages[:i]) if i else _empty_render(tpl)
        after = rendered if i == len(messages) - 1 else tpl.render(messages[: i + 1])
        if not (after.startswith(before) and rendered.startswith(after)):
            raise Refused(f"the template does not render turn {i} as a continuation of the turns before it")
        turn = after[len(before):]
        content = messages[i]["content"]
        at = turn.rfind(content) if content else -1  # the last: a header may hold the same words
        if at < 0 and content.strip():
            at = turn.rfind(content.strip())  # a template that trims the content
        if at < 0:
            at = len(turn.rstrip()) if not content.strip() else -1
        if at < 0:
            raise Refused(f"assistant turn {i}'s content is not in what the template renders for it")
        end = len(turn.rstrip())
        if end > at:
            spans.append((len(before) + at, len(before) + end))
    return spans


def _empty_render(tpl: ChatTemplate) -> str:
    try:
        return tpl.render([])
    except Refused:
        return ""


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span (spans and offsets both ascending)."""
    out, k = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0] and end > start:
            out[t] = 1
    return out


def end_of_turn(tpl: ChatTemplate, tokenizer) -> tuple[str | None, int | None]:
    """(text, id) of the token the template ends an assistant turn with (ChatML's `<|im_end|>`, Llama 3's
    `<|eot_id|>`): what it writes after a turn's content, trailing whitespace left out, when that is one
    token of `tokenizer` (a tokenizers.Tokenizer); else the template's eos_token if it is one; else
    (None, None). Generation stops there (generation_config.json's eos_token_id)."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Fine"}]
    candidates = []
    try:
        before, after = tpl.render(probe[:1]), tpl.render(probe)
        turn = after[len(before):] if after.startswith(before) else after
        at = turn.rfind("Fine")
        if at >= 0:
            candidates.append(turn[at + len("Fine"):].rstrip())
    except Refused:
        pass
    candidates.append(tpl.specials.get("eos_token"))
    for text in candidates:
        if text:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) == 1:
                return text, ids[0]
    return None, None


def chat_record(meta: dict | None) -> dict | None:
    """What a checkpoint records of a `zerodp prepare --chat` folder's template (its meta.json `chat`):
    {"template": the Jinja text, "specials": its bos_token etc., "end_of_turn": token, "end_of_turn_id": id};
    None for other data."""
    chat = (meta or {}).get("chat") or {}
    if not chat.get("template_text"):
        return None
    return {"template": chat["template_text"], "specials": chat.get("template_specials") or {},
            "end_of_turn": chat.get("end_of_turn"), "end_of_turn_id": chat.get("end_of_turn_id")}
