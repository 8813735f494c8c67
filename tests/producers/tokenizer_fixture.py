"""A small tokenizer built offline for tests: no hub, no download.

A word-level vocabulary trained with the ``tokenizers`` library on a tiny corpus,
wrapped in ``transformers.PreTrainedTokenizerFast`` with BOS/EOS/UNK/PAD and a
simple Jinja chat template, saved with ``save_pretrained`` and loaded back through
``AutoTokenizer`` by the code under test. Words outside the corpus (the simulator's
``w123`` tokens) become one ``<unk>`` each, so counting a simulated completion with
it gives the simulator's own token count.
"""

from __future__ import annotations

import os
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} </s> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SPECIAL = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]

CORPUS = [
    "you are a helpful assistant",
    "write a detailed answer about item",
    "tell me a story about the sea",
    "hello how are you today",
    "short chat code math reasoning task prompt",
    "what is the capital of france it is paris",
    "explain the answer step by step",
]


def build_tokenizer(folder: Path) -> Path:
    """Train, wrap and save the tokenizer in ``folder``; returns the folder."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL, min_frequency=1)
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder
