"""A checkpoint's chat template and end ids, against transformers' own tokenizer.

A small tokenizer.json with Llama-3-style special tokens, a tokenizer_config.json carrying
a chat template, and a generation_config.json that lists a second end id are written here;
slotune's prompt ids for a chat must equal those of transformers' ``apply_chat_template``
on the same directory, and every end id must end a request.
"""

from __future__ import annotations

import json

import pytest
import tokenizers
import transformers

from serving.app import openai_api as oa
from serving.app import openai_request as oreq
from serving.model.chat_template import CHAT_TEMPLATE_FILE, ChatTemplate, load_chat_template
from serving.model.tokenizer import load_tokenizer

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]  # fmt: skip
# Written for this test in the shape of Llama 3's: a header per turn, <|eot_id|> after each,
# raise_exception on an unknown role, an open assistant header when asked for.
TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MESSAGES = [("system", "be brief"), ("user", " hello there "), ("assistant", "hi"), ("user", "why")]


@pytest.fixture
def checkpoint(tmp_path):
    words = ["hello", "there", "hi", "why", "be", "brief", "system", "user", "assistant"]
    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(words)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.add_special_tokens(SPECIALS)
    bos = tk.token_to_id("<|begin_of_text|>")
    tk.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    tk.save(str(tmp_path / "tokenizer.json"))
    ids = {t: tk.token_to_id(t) for t in SPECIALS}
    (tmp_path / "config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": ids["<|end_of_text|>"]})
    )
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]})
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": {  # the older files' form of a special token
                    "__type": "AddedToken",
                    "content": "<|end_of_text|>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                },
                "chat_template": TEMPLATE,
            }
        )
    )
    return tmp_path, ids


@pytest.mark.parametrize("add_prompt", [True, False])
def test_chat_prompt_ids_match_transformers(checkpoint, add_prompt) -> None:
    d, _ = checkpoint
    tok = load_tokenizer(d, vocab_size=64)
    assert tok.chat_template is not None
    body = {"messages": [{"role": r, "content": c} for r, c in MESSAGES]}
    req = oreq.parse_chat_request(
        body | {"add_generation_prompt": add_prompt},
        served_model="m",
        chat_template=tok.chat_template,
    )
    ours = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    want = hf.apply_chat_template(
        body["messages"], add_generation_prompt=add_prompt, tokenize=True, return_dict=False
    )
    assert ours == list(want)
    assert ours.count(tok.bos_id) == 1  # the template's BOS, not a second from the tokenizer


def test_every_end_id_is_honoured(checkpoint) -> None:
    d, ids = checkpoint
    tok = load_tokenizer(d, vocab_size=64)
    assert tok.eos_ids == {ids["<|end_of_text|>"], ids["<|eot_id|>"]}


def test_template_refusal_is_a_400_naming_it(checkpoint) -> None:
    d, _ = checkpoint
    tmpl = load_chat_template(d)
    body = {"messages": [{"role": "tool", "content": "x"}]}
    with pytest.raises(oa.ApiError, match="refused the messages: unknown role tool") as e:
        oreq.parse_chat_request(body, served_model="m", chat_template=tmpl)
    assert e.value.status == 400


def test_template_sources(tmp_path) -> None:
    """A chat_template.jinja file wins over tokenizer_config.json; a list of named templates
    gives its ``default``; none at all gives None (the plain template applies)."""
    assert load_chat_template(tmp_path) is None
    cfg = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default",
           "template": "{{ messages[0]['content'] }}!"}]}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(tmp_path).render([("user", "a")]) == "a!"
    (tmp_path / CHAT_TEMPLATE_FILE).write_text("{{ messages | length }}")
    assert load_chat_template(tmp_path).render([("user", "a"), ("user", "b")]) == "2"
    with pytest.raises(ValueError, match="chat template does not parse"):
        ChatTemplate("{% for %}")
