"""Each drafter trainer's own dataset-building code, run on exported files (run by
``bench/trainers.py`` in the trainers' own venv, where torch and the trainers are
installed; not a bench itself, and it imports nothing of tokenbudget).

    driver.py LOADER --tokenizer DIR --out RESULTS.jsonl FILE[:OPTION,...] ...

LOADER is one of :data:`LOADERS`. For each file it writes one JSON line: the file,
the samples the trainer's loader produced, each as ``[input_ids, loss_mask]`` (the
mask over the input positions the loss is taken on), and the error that stopped the
loader, if one did (``"Type: message"``). Judging them is the bench's job: this
script only runs the trainers' code and reports what came out. An OPTION
``last_turn`` sets SpecForge's ``train_only_last_turn``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Every loader runs offline: a hub lookup here would be a bug of the bench.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The largest record of the bench's jobs is a few thousand tokens: nothing is truncated.
MAX_LENGTH = 16384
# The name the tiny tokenizer's template is registered under in SpecForge's registry.
TEMPLATE = "tokenbudget-tiny"

Sample = tuple[list[int], list[int]]


def specforge(path: Path, tokenizer: Any, options: set[str]) -> list[Sample]:
    """SpecForge's prompt preparation (``specforge.data.prompt_builder``), what its
    trainer calls on ``data.train_data_path``: pre-tokenized records (``input_ids`` and
    ``loss_mask`` in the first record) pass through its checks, anything else goes
    through ``build_eagle3_dataset`` with the registered chat template. The
    tokenizer's template renders ``reasoning_content`` and tool calls, so the template
    is registered with the thinking parser (which keeps those keys), as SpecForge's
    own thinking templates are."""
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate

    if TEMPLATE not in TEMPLATE_REGISTRY.get_all_template_names():
        TEMPLATE_REGISTRY.register(
            name=TEMPLATE,
            template=ChatTemplate(
                assistant_header="<|assistant|>",
                user_header="<|user|>",
                system_prompt=None,
                end_of_turn_token="</s>",
                parser_type="thinking",
            ),
        )
    tasks = prepare_prompt_tasks(
        path,
        tokenizer,
        chat_template=TEMPLATE,
        max_length=MAX_LENGTH,
        is_preformatted=False,
        train_only_last_turn="last_turn" in options,
        cache_dir=None,
        cache_key=None,
        num_proc=1,
        # what the EAGLE-3 algorithm asks of a prompt (one_loss_token)
        min_loss_tokens=1,
    )
    return [(list(t["payload"]["input_ids"]), list(t["payload"]["loss_mask"])) for t in tasks]


def speculators(path: Path, tokenizer_dir: Path, options: set[str]) -> list[Sample]:
    """speculators' ``prepare-data`` step (``load_and_preprocess_dataset``): rows
    with ``input_ids`` and ``loss_mask`` pass through, conversations need a vLLM
    render endpoint (there is none here: the loader says so)."""
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset

    dataset, _ = load_and_preprocess_dataset(
        str(tokenizer_dir),
        [str(path)],
        seq_length=MAX_LENGTH,
        build_dataset_num_proc=1,
        render_endpoint=None,
        allow_empty_output=True,
    )
    return [(row["input_ids"].tolist(), row["loss_mask"].tolist()) for row in dataset]


def modelopt_online(path: Path, tokenizer: Any, options: set[str]) -> list[Sample]:
    """Model-Optimizer's online EAGLE-3 data (``examples/speculative_decoding``'s
    ``make_speculative_data_module``, mode ``online``): ``ShardedDataset`` over the
    JSON file and ``LanguageDataCollator`` with ``answer_only_loss`` (the template's
    ``{% generation %}`` tags), one record per batch. A record the collator skips
    gives a batch with no label (its placeholder): it counts as not read."""
    from modelopt.torch.utils.plugins.transformers_dataset import (
        IGNORE_TOKEN_ID,
        LanguageDataCollator,
        ShardedDataset,
    )

    dataset = ShardedDataset("json", data_files=str(path))
    collator = LanguageDataCollator(
        tokenizer=tokenizer,
        train_len=MAX_LENGTH,
        return_labels=True,
        answer_only_loss=True,
        shift_labels=True,
    )
    samples = []
    for index in range(len(dataset)):
        batch = collator([dataset[index]])
        length = int(batch["attention_mask"][0].sum())
        ids = batch["input_ids"][0][:length].tolist()
        labels = batch["labels"][0][:length].tolist()
        # shifted labels: label i is input i + 1, kept where i + 1 is the assistant's
        mask = [0] + [int(label != IGNORE_TOKEN_ID) for label in labels[:-1]]
        if any(mask):
            samples.append((ids, mask))
    return samples


def modelopt_streaming(path: Path, tokenizer: Any, options: set[str]) -> list[Sample]:
    """Model-Optimizer's hidden-state datasets' own tokenization
    (``StreamingDataset._tokenize_entry`` in
    ``modelopt/torch/speculative/plugins/hf_streaming_dataset.py``, before any fetch
    from a server): a record without ``conversation_id`` (or ``uuid``) is passed
    over, as the offline collection asserts it."""
    from datasets import load_dataset
    from modelopt.torch.speculative.plugins.hf_streaming_dataset import (
        StreamingConfig,
        StreamingDataset,
    )

    entries = list(load_dataset("json", data_files=str(path), split="train"))
    dataset = StreamingDataset(
        entries, tokenizer, StreamingConfig(answer_only_loss=True, max_seq_len=MAX_LENGTH)
    )
    samples = []
    for entry in dataset.entries:
        sample = dataset._tokenize_entry(entry)
        if sample is not None:
            samples.append((list(sample["token_ids"]), sample["loss_mask"].tolist()))
    return samples


LOADERS: dict[str, Callable[..., list[Sample]]] = {
    "specforge": specforge,
    "speculators": speculators,
    "modelopt-online": modelopt_online,
    "modelopt-streaming": modelopt_streaming,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("loader", choices=tuple(LOADERS))
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer), local_files_only=True)
    loader = LOADERS[args.loader]
    with args.out.open("w") as out:
        for spec in args.files:
            name, _, opts = spec.partition(":")
            options = set(filter(None, opts.split(",")))
            path = Path(name)
            # speculators loads its processor from the folder itself
            source = args.tokenizer if args.loader == "speculators" else tokenizer
            result: dict[str, Any] = {"file": name, "samples": [], "error": None}
            try:
                result["samples"] = loader(path, source, options)
            except Exception as exc:  # the loader's refusal is the finding: report it
                traceback.print_exc(file=sys.stderr)
                message = " ".join(str(exc).split())
                result["error"] = f"{type(exc).__name__}: {message}"
            out.write(json.dumps(result) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
