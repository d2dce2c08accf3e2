"""Conversations for supervised fine-tuning: MiniMind's JSONL lines, checked, rendered as its
chat template renders them, and tokenized with the loss mask MiniMind trains.

A line is {"conversations": [{"role": ..., "content": ...}, ...]} with the roles system,
user, assistant and tool. An assistant turn may carry "reasoning_content" and "tool_calls",
a system turn "tools" (function specs); both lists come as JSON strings in MiniMind's files,
or as JSON lists. Every turn renders as one block:

    system     <|im_start|>system\\n{content}<|im_end|>\\n                 (the first turn's tools block
               follows its content; a later system turn renders alike, its tools not read)
    user       <|im_start|>user\\n{content}<|im_end|>\\n
    assistant  <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{content}{tool calls}<|im_end|>\\n
    tool       <|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n   (consecutive
               tool turns share one such block)

which is what model/tokenizer_config.json's chat template renders (tests/test_chat.py holds
the two to each other). The loss covers what MiniMind's covers: each assistant block after
its header `<|im_start|>assistant\\n`, through its `<|im_end|>`.
"""
import json
from dataclasses import dataclass

from common.errors import DataError
from dataset.lm_dataset import load_json_line

ROLES = ("system", "user", "assistant", "tool")
EXPECTED = '{"conversations": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
START, END = "<|im_start|>", "<|im_end|>"
ASSISTANT_HEADER = f"{START}assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
# What a chat model is prompted with to answer (the template's add_generation_prompt): thinking
# left empty, as MiniMind's template has it unless open_thinking is asked for.
GENERATION_PROMPT = ASSISTANT_HEADER + EMPTY_THINK
TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


# -----------------------------------------------------------------------------
# reading a line

def parse_conversation(raw: bytes, where: str) -> list[dict]:
    """The turns of one JSONL line, each {"role", "content"} and, where given, "reasoning_content",
    "tool_calls" and "tools" (lists, parsed from their JSON strings); or a DataError naming `where`."""
    obj = load_json_line(raw, where, f"each line must be like {EXPECTED}")
    turns = obj.get("conversations") if isinstance(obj, dict) else None
    if not isinstance(turns, list) or not turns:
        found = f"keys: {', '.join(map(json.dumps, list(obj)[:5]))}" if isinstance(obj, dict) else "not an object"
        raise DataError(f'{where}: no "conversations" list of turns ({found}); each line must be like {EXPECTED}')
    return [_parse_turn(turn, f"{where}: turn {number}") for number, turn in enumerate(turns, start=1)]


def _parse_turn(turn, where: str) -> dict:
    if not isinstance(turn, dict):
        raise DataError(f'{where}: a turn must be an object with "role" and "content"')
    role, content = turn.get("role"), turn.get("content")
    if role not in ROLES:
        said = f"role {role!r}" if "role" in turn else 'no "role"'
        raise DataError(f"{where}: {said}; a turn's role is one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        said = f'"content" is a JSON {type(content).__name__}' if "content" in turn else 'no "content"'
        raise DataError(f'{where}: {said}; a turn\'s content is a string (it may be "")')
    parsed = {"role": role, "content": content}
    reasoning = turn.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise DataError(f'{where}: "reasoning_content" must be a string')
    if reasoning is not None:
        parsed["reasoning_content"] = reasoning
    for field in ("tool_calls", "tools"):
        value = _json_list(turn.get(field), f"{where}: {field!r}")
        if value:
            parsed[field] = value
    return parsed


def _json_list(value, where: str):
    """A list given as itself or as a JSON string of one; None and "" are no list."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{where} is not valid JSON ({e.msg}); give a JSON list, or a string of one") from None
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise DataError(f"{where} must be a list of objects")
    return value


# -----------------------------------------------------------------------------
# rendering

@dataclass(frozen=True)
class Block:
    """One rendered block of a conversation, and the part of it the loss covers."""
    text: str
    trained: tuple[int, int] | None = None  # [start, end) within text; None: no loss here


def render(turns: list[dict], keep_empty_think: bool = True) -> list[Block]:
    """The conversation as the chat template renders it, block by block. keep_empty_think=False
    leaves out an assistant block's empty <think> block (MiniMind's data drops it 80% of the time)."""
    tools = None
    for turn in turns:  # as MiniMind's SFTDataset does: the last system turn's tools
        if turn["role"] == "system" and "tools" in turn:
            tools = turn["tools"]
    blocks = []
    first_is_system = turns[0]["role"] == "system"
    if tools or first_is_system:
        content = turns[0]["content"] if first_is_system else ""
        if tools:
            intro = content + "\n\n" if first_is_system else ""
            content = intro + TOOLS_INTRO + "".join("\n" + _json(tool) for tool in tools) + TOOLS_OUTRO
        blocks.append(Block(f"{START}system\n{content}{END}\n"))
    for i, turn in enumerate(turns):
        role = turn["role"]
        if role == "user" or (role == "system" and i > 0):
            blocks.append(Block(f"{START}{role}\n{turn['content']}{END}\n"))
        elif role == "assistant":
            body = _assistant_body(turn, keep_empty_think)
            start = len(ASSISTANT_HEADER)
            blocks.append(Block(f"{ASSISTANT_HEADER}{body}{END}\n", (start, start + len(body) + len(END))))
        elif role == "tool":  # consecutive tool results share one user block
            piece = f"\n<tool_response>\n{turn['content']}\n</tool_response>"
            if i == len(turns) - 1 or turns[i + 1]["role"] != "tool":
                piece += f"{END}\n"
            if i > 0 and turns[i - 1]["role"] == "tool":
                blocks[-1] = Block(blocks[-1].text + piece)
            else:
                blocks.append(Block(f"{START}user{piece}"))
    return blocks


def _assistant_body(turn: dict, keep_empty_think: bool) -> str:
    content = turn["content"]
    reasoning = turn.get("reasoning_content")
    if reasoning is None:
        reasoning = ""
        if "</think>" in content:  # reasoning written inline, as <think>...</think> answer
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    think = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
    body = ("" if think == EMPTY_THINK and not keep_empty_think else think) + content.lstrip("\n")
    for n, call in enumerate(turn.get("tool_calls") or []):
        call = call.get("function") or call
        arguments = call.get("arguments")
        arguments = arguments if isinstance(arguments, str) else _json(arguments)
        separator = "\n" if n > 0 or content else ""
        body += f'{separator}<tool_call>\n{{"name": "{call.get("name", "")}", "arguments": {arguments}}}\n</tool_call>'
    return body


def _json(value) -> str:
    # The template's tojson filter, as transformers defines it.
    return json.dumps(value, ensure_ascii=False)


def generation_prompt(turns: list[dict]) -> str:
    """The text a chat model reads before it answers: the conversation so far, then the prompt."""
    return "".join(block.text for block in render(turns)) + GENERATION_PROMPT


# -----------------------------------------------------------------------------
# tokenizing, with the loss mask

@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    trained: list[bool]  # per token: a target of the loss
    block_ends: list[int]  # the token count after each block

    def cut(self, max_tokens: int) -> "Encoded | None":
        """The complete blocks that fit in max_tokens; None where they hold no trained token."""
        keep = max((end for end in self.block_ends if end <= max_tokens), default=0)
        if not any(self.trained[:keep]):
            return None
        return Encoded(self.ids[:keep], self.trained[:keep], [end for end in self.block_ends if end <= keep])


def encode(tokenizer, blocks: list[Block]) -> Encoded:
    """Tokenize the rendered conversation as ONE string (as the template's text is tokenized at
    inference; a block's text alone can tokenize differently at its edges) and mark each token
    whose text starts inside a trained span."""
    return encode_many(tokenizer, [blocks])[0]


def encode_many(tokenizer, conversations: list[list[Block]]) -> list[Encoded]:
    """encode() of each conversation, tokenized in one batch (the fast tokenizer's threads)."""
    texts = ["".join(block.text for block in blocks) for blocks in conversations]
    batch = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [_marked(blocks, ids, [start for start, _ in offsets])
            for blocks, ids, offsets in zip(conversations, batch["input_ids"], batch["offset_mapping"])]


def _marked(blocks: list[Block], ids: list[int], starts: list[int]) -> Encoded:
    spans, block_starts, offset = [], [], 0
    for block in blocks:
        block_starts.append(offset)
        if block.trained:
            spans.append((offset + block.trained[0], offset + block.trained[1]))
        offset += len(block.text)
    trained = [any(a <= s < b for a, b in spans) for s in starts]
    # Every block starts with <|im_start|>, a special token: a token boundary.
    block_ends = [sum(1 for s in starts if s < end) for end in block_starts[1:] + [offset]]
    return Encoded(list(ids), trained, block_ends)
