"""What each drafter trainer's loader checks of a record, restated from its source
(August 2026) so the unit tests hold the export to it without the trainers and
torch installed (bench/trainers.py runs the trainers' own code on real exports).

* SpecForge (sgl-project/SpecForge): ``scripts/validate_regenerated_data.py``
  ``validate_row`` and ``scripts/conversation_validation.py`` (a non-empty string
  ``id``, ``status == "success"``, content strings, the last turn the assistant's);
  ``specforge/data/preprocessing.py`` ``build_eagle3_dataset`` (it pops
  ``conversations``, ``id`` and ``tools``, parsing ``tools`` from JSON text; every
  other column reaches the chat template as a keyword argument);
  ``specforge/data/parse.py`` (the roles it renders: system first, then user,
  assistant and tool turns, a tool turn after an assistant or tool one);
  ``specforge/data/prompt_builder.py`` ``_prompt_from_record`` (pre-tokenized rows).
* speculators (vllm-project/speculators): ``scripts/response_regeneration/script.py``
  ``_sample_from_response`` (the row it writes) and
  ``src/speculators/data_generation/preprocessing.py`` ``_passthrough_pretokenized``.
* Model-Optimizer (NVIDIA/Model-Optimizer):
  ``modelopt/torch/utils/plugins/transformers_dataset.py`` ``LanguageDataCollator``
  (a string ``text`` wins over ``messages``; a sample needs an assistant turn);
  ``examples/speculative_decoding/collect_hidden_states/compute_hidden_states_hf.py``
  (asserts ``conversation_id``, names ``<conversation_id>.pt`` after it) and
  ``modelopt/torch/speculative/plugins/hf_streaming_dataset.py`` (prefers
  ``conversations`` over ``messages``).
"""

from __future__ import annotations

import itertools
import json
import re
from numbers import Integral
from typing import Any

ROLES = {"system", "user", "assistant", "tool"}


def specforge_conversation(record: dict[str, Any]) -> None:
    assert set(record) <= {"id", "conversations", "status", "tools"}, set(record)
    assert isinstance(record["id"], str) and record["id"].strip()
    assert record["status"] == "success"
    if "tools" in record:
        assert isinstance(json.loads(record["tools"]), list)  # JSON text, parsed there
    turns = record["conversations"]
    assert isinstance(turns, list) and turns and turns[-1]["role"] == "assistant"
    roles = [turn["role"] for turn in turns]
    assert set(roles) <= ROLES and "system" not in roles[1:]
    assert roles[1 if roles[0] == "system" else 0] == "user"
    assert isinstance(turns[0]["content"], str)
    for before, turn in itertools.pairwise(turns):
        assert isinstance(turn["content"], str)
        if turn["role"] == "tool":
            assert before["role"] in ("assistant", "tool")
        if turn["role"] == "assistant":
            assert before["role"] in ("user", "tool")
        for call in turn.get("tool_calls") or ():
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
    reasoning = [t.get("reasoning_content") for t in turns if t["role"] == "assistant"]
    assert all(r is None or isinstance(r, str) for r in reasoning)


def specforge_expanded(record: dict[str, Any]) -> None:
    """A record of ``expand_reasoning_conversations.py``'s shape: the history shows
    no earlier answer's thinking, the last turn keeps its own."""
    specforge_conversation(record)
    *history, _ = record["conversations"]
    assert not any("reasoning_content" in turn for turn in history)


def pretokenized(record: dict[str, Any]) -> None:
    """SpecForge's ``_prompt_from_record`` and speculators' passthrough."""
    ids, mask = record["input_ids"], record["loss_mask"]
    assert ids and len(ids) == len(mask)
    assert all(isinstance(i, Integral) and not isinstance(i, bool) for i in ids)
    assert set(mask) <= {0, 1} and sum(mask) > 0


def specforge_ids(record: dict[str, Any]) -> None:
    assert set(record) == {"id", "input_ids", "loss_mask"}
    assert isinstance(record["id"], str) and record["id"].strip()
    pretokenized(record)


def speculators_row(record: dict[str, Any]) -> None:
    assert set(record) == {"id", "primary_id", "input_ids", "loss_mask", "metadata"}
    assert re.fullmatch(re.escape(record["primary_id"]) + r"_gen\d+", record["id"])
    assert isinstance(record["metadata"]["finish_reason"], str)
    assert isinstance(record["metadata"]["is_tool_call"], bool)
    pretokenized(record)


def modelopt_record(record: dict[str, Any]) -> None:
    assert set(record) == {"conversation_id", "messages"}  # no "text" nor "conversations"
    # names its hidden-state file, <conversation_id>.pt
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", record["conversation_id"])
    assert any(m["role"] == "assistant" for m in record["messages"])
    assert all(isinstance(m["content"], str) for m in record["messages"])
