"""A Hugging Face checkpoint served by the live app on Ray Serve: its name, its chat
template and every one of its end ids, through the OpenAI API over loopback HTTP.

A small random Qwen2 (q/k/v biases) is saved by transformers with a word-level
tokenizer, a chat template and a generation_config.json whose end ids include one that
config.json does not list: the greedy first token of the test's chat prompt.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from serving.app.config import LiveConfig, ServerArgs

APP, PREFIX, NAME = "t-ckpt", "/t-ckpt", "qwen-test"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]


def _checkpoint(d, eos_extra: int | None) -> None:
    import tokenizers
    import transformers

    words = [f"w{i}" for i in range(61)]
    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(words)}  # 62 ids
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.decoder = tokenizers.decoders.WordPiece()
    tk.add_special_tokens(["<|im_start|>", "<|im_end|>"])  # ids 62, 63
    tk.save(str(d / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=63,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(d)
    (d / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE})
    )
    ends = [63] + ([eos_extra] if eos_extra is not None else [])
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))


def _greedy(d, max_tokens: int) -> list[int]:
    """What slotune's own engine generates for the chat prompt transformers renders."""
    import transformers

    from serving.engine.engine import Engine

    ids = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    eng = Engine(checkpoint=str(d), max_slots=1, max_batch_size=1, max_len=64, num_threads=1)
    return eng.generate(list(ids), max_tokens=max_tokens)  # no stop ids: all max_tokens


@pytest.mark.ray
@pytest.mark.slow
def test_served_checkpoint_names_itself_renders_its_template_and_stops_at_every_end(
    ray_cluster, tmp_path
) -> None:
    import tokenizers

    from serving.app.deploy import delete_app, deploy_app

    plain = tmp_path / "plain"
    plain.mkdir()
    _checkpoint(plain, None)
    want = _greedy(plain, 6)
    assert want[0] != 63, "the seed's first token is config.json's own end id: pick another"
    served = want[: want.index(63)] if 63 in want else want
    ends = tmp_path / "ends"  # the same model, whose generation_config ends at want[0]
    ends.mkdir()
    _checkpoint(ends, want[0])
    base = ray_cluster.http_url + PREFIX
    for d in (plain, ends):
        deploy_app(
            ServerArgs(model="tiny", checkpoint=str(d), served_model_name=NAME, max_slots=4,
                       max_len=64),
            LiveConfig(max_batch_size=4, max_ongoing_requests=4),
            name=APP,
            route_prefix=PREFIX,
        )  # fmt: skip
        try:
            models = httpx.get(base + "/v1/models", timeout=30).json()
            assert [m["id"] for m in models["data"]] == [NAME]
            r = httpx.post(
                base + "/v1/chat/completions",
                json={"model": NAME, "messages": MESSAGES, "max_tokens": 6, "temperature": 0},
                timeout=60,
            )
            r.raise_for_status()
            body = r.json()
            if d is plain:  # the template's prompt: the same tokens as transformers' prompt
                assert body["usage"]["completion_tokens"] == len(served)
                tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
                text = body["choices"][0]["message"]["content"]
                assert text.split() == tok.decode(served).split()
            else:  # the first token is an end id listed only in generation_config.json
                assert body["choices"][0]["finish_reason"] == "stop"
                assert body["usage"]["completion_tokens"] == 0
        finally:
            delete_app(APP)
