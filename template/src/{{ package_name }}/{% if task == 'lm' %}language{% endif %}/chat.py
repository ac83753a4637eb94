"""Chat: a conversation rendered into tokens, and which of those tokens the loss covers.

A conversation is a list of messages `{"role": "system" | "user" | "assistant", "content":
str}`, as OpenAI's API and Hugging Face chat datasets write them. It becomes text through a
chat template, a Jinja template over `messages` and `add_generation_prompt`:

- the tokenizer's own: `chat_template` in a `tokenizer_config.json` (or a `chat_template.jinja`)
  beside its tokenizer.json, as a Hugging Face model folder has it (`--tokenizer FOLDER`; its
  `bos_token`, `eos_token`... are in the template's context too). It is rendered as
  transformers' `apply_chat_template` renders it: jinja2 (a dependency of torch) in an
  immutable sandbox, `trim_blocks` and `lstrip_blocks`, its `tojson`, `raise_exception` and
  `strftime_now`, and its `generation` blocks allowed (read as plain text);
- else `DEFAULT_TEMPLATE`, for the project's own tokenizers: each message as
  `<|ROLE|>\\nCONTENT` followed by the end-of-turn token, `<|endoftext|>` (a trained BPE's,
  one token), a model folder's own special eos token where it has no `<|endoftext|>`
  (Llama-2's `</s>`) or, for `--tokenizer bytes`, the byte 0x04 (ASCII end of transmission);
  the generation prompt is `<|assistant|>\\n`. The role names are plain text.

Special tokens (the tokenizer's added tokens marked special) written by the template become
their ids; the text between them is encoded as text. Text is also cut where each
assistant's turn begins and ends, so a turn's tokens are the same in training and when
`generate --chat` continues the conversation from `render_chat(..., add_generation_prompt=
True)`.

The loss mask (`chat_tokens_and_mask`) is True on exactly an assistant's turn: the text from
where the generation prompt ends (the template's rendering of the conversation up to that
message with `add_generation_prompt=True`) to the end of the first special token after it,
the end-of-turn token, which the model must learn to say, or to the end of the message's
rendering where no special token follows. Everything else, the system and user messages,
the role headers and the template's scaffolding after an end-of-turn token, is False. A
template whose rendering of an earlier part of the conversation is not the start of the
whole one (one that rewrites earlier turns) is refused: the turn's place is then unknown.

In a token file the mask belongs to the targets: token `j` with mask True is a target the
loss covers (predicted from the tokens before it); training sets the others to
`IGNORE_INDEX` (the prepared chat data, language/chat_data.py).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cache
from typing import Any

from ..training.data_sources import DataError
from .tokenizer import EOT, HFTokenizer, Tokenizer

IGNORE_INDEX = -100  # a target the loss leaves out (F.cross_entropy's ignore_index default)
ROLES = ("system", "user", "assistant")
BYTES_END_OF_TURN = "\x04"  # --tokenizer bytes: ASCII end of transmission ends a turn
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def check_messages(messages: object, where: str = "the conversation") -> list[dict[str, str]]:
    """The messages as a list of {"role", "content"}, or one line saying what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of (role, content) objects")
    checked = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: message {number} is not an object with a role and a content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DataError(
                f"{where}: message {number}'s role is {role!r}, not one of {', '.join(ROLES)}"
            )
        if not isinstance(content, str):
            raise DataError(f"{where}: message {number}'s content is not text")
        if not content.isascii():
            try:
                content.encode("utf-8")
            except UnicodeEncodeError as error:  # JSON's "\ud800": half a UTF-16 pair
                raise DataError(
                    f"{where}: message {number}'s content holds a lone surrogate "
                    f"({content[error.start]!r}), which is no Unicode character"
                ) from None
        checked.append({**message, "role": role, "content": content})
    return checked


def chat_template(tokenizer: Tokenizer) -> tuple[str, dict[str, str]]:
    """(template, special-token strings of its context) the tokenizer's conversations use."""
    own = tokenizer.chat_config
    if own is not None:
        return own["template"], dict(own["tokens"])
    if tokenizer.kind == "bytes":
        return DEFAULT_TEMPLATE, {"eos_token": BYTES_END_OF_TURN}
    if tokenizer.eot is not None:
        return DEFAULT_TEMPLATE, {"eos_token": EOT}
    specials = {i: name for name, i in _specials(tokenizer).items()}
    folder_eos = [specials[i] for i in tokenizer.eos_ids if i in specials]
    if folder_eos:  # a folder's own special eos token (Llama-2's </s>) ends a turn instead
        return DEFAULT_TEMPLATE, {"eos_token": folder_eos[0]}
    raise DataError(
        "the tokenizer has no chat template (a tokenizer_config.json with chat_template "
        f"beside its tokenizer.json) and no {EOT} token or special eos token of its model "
        "folder to end a turn in the default one"
    )


def render_text(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], gen: bool) -> str:
    """The conversation as the chat template writes it."""
    template, tokens = chat_template(tokenizer)
    try:
        return str(
            _compiled(template).render(messages=list(messages), add_generation_prompt=gen, **tokens)
        )
    except Exception as error:  # jinja2's errors and the template's raise_exception
        raise DataError(f"the chat template failed: {error}") from None


def render_chat(
    tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool
) -> list[int]:
    """The conversation's token ids; with `add_generation_prompt` the assistant's turn is
    opened (what the model continues)."""
    return [token for token, _ in _tokens(tokenizer, messages, add_generation_prompt)]


def chat_tokens_and_mask(
    tokenizer: Tokenizer, messages: Sequence[dict[str, Any]]
) -> tuple[list[int], list[bool]]:
    """(token ids, mask): the mask True exactly on the assistants' tokens, each turn's
    end-of-turn token included (see the module's docstring)."""
    pairs = _tokens(tokenizer, messages, False)
    return [token for token, _ in pairs], [loss for _, loss in pairs]


def end_of_turn_ids(tokenizer: Tokenizer) -> list[int]:
    """The tokens that end an assistant's turn (where generation stops): the special token
    the template writes after an assistant's message, the eos token (a special token, or
    text of one token: the default template's 0x04 for bytes), the end-of-text token and a
    model folder's own eos tokens."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    tokens, mask = chat_tokens_and_mask(tokenizer, probe)
    _, named = chat_template(tokenizer)
    specials = _specials(tokenizer)
    last = [token for token, covered in zip(tokens, mask, strict=True) if covered][-1:]
    found = {token for token in last if token in specials.values()}  # not a text token
    eos = _encode(tokenizer, named["eos_token"], specials) if "eos_token" in named else []
    if len(eos) == 1:
        found.add(eos[0])
    return sorted(found | tokenizer.end_ids())


def _tokens(
    tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], gen: bool
) -> list[tuple[int, bool]]:
    """(token, in an assistant's turn) of the rendered conversation."""
    messages = check_messages(list(messages))
    text = render_text(tokenizer, messages, gen)
    specials = _specials(tokenizer)
    pattern = _special_pattern(tuple(specials))
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_text(tokenizer, messages[:index], True) if index else ""
        upto = render_text(tokenizer, messages[: index + 1], False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise DataError(
                f"the chat template renders the conversation up to message {index} otherwise "
                "than the whole conversation begins; its turns cannot be told apart"
            )
        end = len(upto)
        special = pattern.search(text, len(before), end) if pattern else None
        spans.append((len(before), special.end() if special else end))
    cuts = sorted({0, len(text), *(at for span in spans for at in span)})
    pairs: list[tuple[int, bool]] = []
    for start, stop in itertools.pairwise(cuts):
        inside = any(a <= start and stop <= b for a, b in spans)
        pairs.extend((token, inside) for token in _encode(tokenizer, text[start:stop], specials))
    return pairs


def _encode(tokenizer: Tokenizer, text: str, specials: dict[str, int]) -> list[int]:
    """Text's tokens, its special tokens' strings as their ids."""
    pattern = _special_pattern(tuple(specials))
    ids, at = [], 0
    for found in pattern.finditer(text) if pattern else ():
        ids += tokenizer.encode(text[at : found.start()].encode("utf-8")) if found.start() else []
        ids.append(specials[found.group()])
        at = found.end()
    if at < len(text):
        ids += tokenizer.encode(text[at:].encode("utf-8"))
    return ids


def _specials(tokenizer: Tokenizer) -> dict[str, int]:
    """The tokenizer's special tokens: their strings and ids (bytes: none)."""
    if not isinstance(tokenizer, HFTokenizer):
        return {}
    decoder = tokenizer.inner.get_added_tokens_decoder()
    return {token.content: i for i, token in decoder.items() if token.special}


@cache
def _special_pattern(strings: tuple[str, ...]) -> re.Pattern[str] | None:
    """A pattern finding any of the strings, the longest first where two start alike."""
    if not strings:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)))


@cache
def _compiled(template: str) -> Any:
    """The template compiled as transformers compiles a chat template."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with
        it): its text, as if the tags were not there."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 reads the class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[Generation, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return environment.from_string(template)
    except jinja2.exceptions.TemplateError as error:
        raise DataError(f"the chat template is not a Jinja template this reads ({error})") from None
