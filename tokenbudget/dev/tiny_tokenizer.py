"""A tiny tokenizer with a chat template, built offline (developer tool: the demo,
the fault jobs and the tests use it; no hub, no download).

A word-level vocabulary trained with the ``tokenizers`` library on a small corpus,
wrapped in ``transformers.PreTrainedTokenizerFast`` with BOS/EOS/UNK/PAD and a
simple Jinja chat template, saved with ``save_pretrained`` so it loads back through
``AutoTokenizer`` like a model's own tokenizer folder. Words outside the corpus (the
simulator's ``w123`` tokens) become one ``<unk>`` each, so counting a simulated
completion with it gives the simulator's own token count.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenbudget.producers.prompts.datasets import read_prompts

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} </s> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SPECIAL = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]

# A thinking model's template: the answer opens in a thinking block (as DeepSeek R1's
# and Kimi's templates open it), closed at once when the template's switch turns
# thinking off (Qwen3's enable_thinking, DeepSeek's and Kimi's thinking), so the
# model answers straight away.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{% if add_generation_prompt %}<|assistant|> <think>"
    "{% if enable_thinking is false or thinking is false %} </think>{% endif %}"
    "{% endif %}",
)
# Plain (not special) tokens, as in Qwen3's vocabulary: decoding keeps them, so the
# thinking markers survive in decoded text.
THINKING_MARKERS = ["<think>", "</think>"]

CORPUS = [
    "you are a helpful assistant",
    "write a detailed answer about item",
    "tell me a story about the sea",
    "hello how are you today",
    "short chat code math reasoning task prompt",
    "what is the capital of france it is paris",
    "explain the answer step by step",
]


def build_tokenizer(
    folder: Path,
    corpus: Iterable[str] = CORPUS,
    *,
    whole_words: Sequence[str] = (),
    thinking: bool = False,
) -> Path:
    """Train on ``corpus``, wrap and save the tokenizer in ``folder``; returns the folder.

    ``whole_words`` stay one token each even where the word splitter would cut them
    (``#chat`` would be ``#`` and ``chat``), so decoding gives them back intact.
    ``thinking``: a thinking model's tokenizer, with ``<think>`` and ``</think>`` as
    tokens and :data:`THINKING_TEMPLATE`."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    # transformers' import-time advice (no PyTorch, ...) is noise in the demo's output.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL, min_frequency=1)
    tokenizer.train_from_iterator(corpus, trainer)
    added = [*whole_words, *(THINKING_MARKERS if thinking else ())]
    if added:
        tokenizer.add_tokens([AddedToken(word, normalized=False) for word in added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = THINKING_TEMPLATE if thinking else CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


# A tokenizer shipped as code in its folder, as Kimi-K2's is (tiktoken-based, named by
# an auto_map): the tiny tokenizer under another class, which says that it ran.
OWN_CODE_MODULE = "tokenization_tiny"
OWN_CODE = (
    "from transformers import PreTrainedTokenizerFast\n\n\n"
    "class TinyCodeTokenizer(PreTrainedTokenizerFast):\n"
    '    """The tiny tokenizer, loaded from this file: only with trust_remote_code."""\n\n'
    "    ran_folder_code = True\n"
)


def ship_own_code(folder: Path) -> Path:
    """Make the tokenizer saved in ``folder`` one that ships its own code: a
    ``tokenization_tiny.py`` subclassing the transformers tokenizer, which
    ``tokenizer_config.json`` names in its ``auto_map`` (transformers loads it only
    with ``trust_remote_code``); returns the folder."""
    (folder / f"{OWN_CODE_MODULE}.py").write_text(OWN_CODE)
    settings_file = folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    settings["tokenizer_class"] = "TinyCodeTokenizer"
    settings["auto_map"] = {"AutoTokenizer": [None, f"{OWN_CODE_MODULE}.TinyCodeTokenizer"]}
    settings_file.write_text(json.dumps(settings, indent=2))
    return folder


def dataset_corpus(paths: Iterable[Path]) -> list[str]:
    """Every prompt text and message of these datasets (any format ``auto`` reads),
    to train on: a tokenizer that knows every word gives distinct prompts distinct ids."""
    corpus: list[str] = []
    for path in paths:
        # Bad rows are the run's to report; they have no words to learn.
        for row in read_prompts("corpus", path, on_bad_row=lambda _: None):
            if row.text is not None:
                corpus.append(row.text)
            corpus += [m.content for m in row.messages or ()]
    return corpus
