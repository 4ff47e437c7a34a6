"""A checkpoint's own chat template: the Jinja text its ``tokenizer_config.json`` (or a
``chat_template.jinja`` beside it) carries, rendered as transformers' ``apply_chat_template``
renders it, so ``/v1/chat/completions`` gives the model the prompt it was trained on.

The environment is what templates in the wild are written against (transformers'
chat_template_utils.py states it): Jinja's immutable sandbox, ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that leaves
non-ASCII and HTML characters as they are, and the globals ``raise_exception(message)``
and ``strftime_now(format)`` (Llama 3.1's templates date their system prompt with it).
Variables: ``messages`` (``role`` and ``content`` each), ``add_generation_prompt``,
``bos_token``, ``eos_token``. The rendered text already holds the special tokens the
template writes, so it is tokenized without the tokenizer's own (``add_special_tokens``
false, as transformers and vLLM do).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

CHAT_TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not parse: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(
        self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of (role, content) messages; ValueError with the template's own
        message where it refuses them (e.g. roles that do not alternate)."""
        import jinja2

        try:
            return self._template.render(
                messages=[{"role": r, "content": c} for r, c in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the model's chat template refused the messages: {e}") from None


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def token_text(v: object) -> str:
    """A special token as tokenizer_config.json states it: a string or ``{"content": ...}``."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else ""


def load_chat_template(checkpoint_dir: str | Path) -> ChatTemplate | None:
    """The checkpoint's template (``chat_template.jinja``, else tokenizer_config.json's
    ``chat_template``: a string, or a list of named ones of which ``default`` is taken), or
    None when it has none."""
    d = Path(checkpoint_dir)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    source: object = cfg.get("chat_template")
    if (d / CHAT_TEMPLATE_FILE).is_file():
        source = (d / CHAT_TEMPLATE_FILE).read_text()
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(
        source,
        bos_token=token_text(cfg.get("bos_token")),
        eos_token=token_text(cfg.get("eos_token")),
    )
