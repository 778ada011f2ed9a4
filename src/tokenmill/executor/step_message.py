"""Rank 0's messages to the other ranks, as one int32 buffer: a step's description (which tokens of which
sequences at which positions, their block tables in each KV pool, the block copies before it), the KV cache's
size, a LoRA adapter to load (its id, and its path as UTF-8 bytes) or drop, a ping or the end. A step is one
broadcast of CAPACITY int32s (16 KiB) when its description fits, which a decode step of 64 sequences or a
512-token prefill does; a longer one sends its remainder in a second broadcast.
"""

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

from tokenmill.runner.model_runner import StepChunk

if TYPE_CHECKING:
    from tokenmill.distributed.group import ParallelGroup

CAPACITY = 4096  # int32s in the first broadcast
HEADER = 4  # kind, total length, argument, local_argument


class Kind(IntEnum):
    STEP = 1
    ALLOCATE = 2  # argument: the number of KV blocks; local_argument: those of the sliding-window layers' pool
    PING = 3  # a step with no tokens: rank 0 checks that every rank still answers
    SHUTDOWN = 4
    LOAD_LORA = 5  # argument: the adapter's id; text: its path (every rank reads its own part of the file)
    UNLOAD_LORA = 6  # argument: the adapter's id


@dataclass
class Message:
    kind: Kind
    argument: int = 0
    chunks: list[StepChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    local_argument: int = 0
    local_block_copies: list[tuple[int, int]] = field(default_factory=list)
    text: str = ""  # LOAD_LORA's path


def encode(message: Message) -> torch.Tensor:
    """-> int32 [max(CAPACITY, length)]: header, then for a step the copies and every chunk."""
    body: list[int] = []
    if message.kind == Kind.STEP:
        body += [len(message.chunks), len(message.block_copies), len(message.local_block_copies)]
        for src, dst in message.block_copies + message.local_block_copies:
            body += [src, dst]
        for c in message.chunks:
            flags = int(c.want_last_logits) | int(c.want_all_logits) << 1 | int(c.want_hidden) << 2
            prompt_len = -1 if c.prompt_len is None else c.prompt_len
            local = c.local_block_table
            body += [len(c.token_ids), c.start_position, prompt_len, flags, len(c.block_table)]
            body += [-1 if local is None else len(local), c.lora_id]
            body += c.token_ids
            body += c.block_table
            body += local or []
    elif message.kind == Kind.LOAD_LORA:
        body += list(message.text.encode())
    length = HEADER + len(body)
    buffer = torch.zeros(max(CAPACITY, length), dtype=torch.int32)
    header = [int(message.kind), length, message.argument, message.local_argument]
    buffer[:length] = torch.tensor([*header, *body], dtype=torch.int32)
    return buffer


def total_length(first: torch.Tensor) -> int:
    """The message's length in int32s, from its first CAPACITY."""
    return int(first[1])


def decode(buffer: torch.Tensor) -> Message:
    values = buffer[: total_length(buffer)].tolist()
    kind, _, argument, local_argument = values[:HEADER]
    message = Message(Kind(kind), argument, local_argument=local_argument)
    if message.kind == Kind.LOAD_LORA:
        message.text = bytes(values[HEADER:]).decode()
    if message.kind != Kind.STEP:
        return message
    num_chunks, num_copies, num_local_copies = values[HEADER : HEADER + 3]
    i = HEADER + 3
    copies = [(values[i + 2 * j], values[i + 2 * j + 1]) for j in range(num_copies + num_local_copies)]
    message.block_copies, message.local_block_copies = copies[:num_copies], copies[num_copies:]
    i += 2 * (num_copies + num_local_copies)
    for _ in range(num_chunks):
        n, start, prompt_len, flags, num_blocks, num_local, lora_id = values[i : i + 7]
        i += 7
        tokens, table = values[i : i + n], values[i + n : i + n + num_blocks]
        i += n + num_blocks
        local = values[i : i + num_local] if num_local >= 0 else None
        i += max(num_local, 0)
        message.chunks.append(
            StepChunk(
                token_ids=tokens,
                start_position=start,
                block_table=table,
                local_block_table=local,
                want_last_logits=bool(flags & 1),
                want_all_logits=bool(flags & 2),
                want_hidden=bool(flags & 4),
                prompt_len=None if prompt_len < 0 else prompt_len,
                lora_id=lora_id,
            )
        )
    return message


def send(group: "ParallelGroup", message: Message) -> None:
    """Rank 0: broadcast the message (one broadcast, two when it is longer than CAPACITY)."""
    buffer = encode(message)
    group.broadcast_control(buffer[:CAPACITY])
    if buffer.shape[0] > CAPACITY:
        group.broadcast_control(buffer[CAPACITY:].clone())


def receive(group: "ParallelGroup", first: torch.Tensor) -> Message:
    """Another rank: wait for rank 0's next message (`first`: a reused int32 [CAPACITY] buffer)."""
    group.broadcast_control(first)
    length = total_length(first)
    if length <= CAPACITY:
        return decode(first)
    rest = torch.empty(length - CAPACITY, dtype=torch.int32)
    group.broadcast_control(rest)
    return decode(torch.cat([first, rest]))
