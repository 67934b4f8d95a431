"""Training data: read rows, tokenize with loss masks, pack into blocks, batch resumably.

Row schemas (one JSON object per line in a .jsonl file, or rows of a `datasets` directory):

- `{"text": ...}`: loss on every token.
- `{"prompt": ..., "completion": ...}`: loss on the completion (and the closing eos) only.
- `{"messages": [{"role": ..., "content": ...}, ...]}`: rendered by the tokenizer's chat
  template. A role outside CHAT_ROLES, or a conversation without an assistant turn, is refused
  naming the line (it would silently put the loss on every token). Decision: loss on the assistant turns only, found by rendering each prefix of
  the conversation; this is exact when every prefix renders to a string prefix of the full
  conversation (true of common templates). A template that renders an assistant turn
  otherwise once later turns follow (Qwen3's gives only the last one its empty thinking block)
  has that turn found by its own text and the way the turn closes (the eos after it); an empty
  turn there (a tool call's) trains nothing. Where even that fails (a template that rewrites
  the text of earlier turns), the loss falls back to everything after the last user turn (if
  even that prefix cannot be found, all tokens), and the run warns once with how many
  conversations did.

Blocks: the tokenized rows are concatenated (each row ends with eos) and cut into blocks of
exactly `seq_len` tokens (`pack=True`, the default; the last partial block is padded), or each
row is truncated/padded to `seq_len` on its own (`pack=False`). Labels follow the Hugging Face
convention: same positions as input_ids (the model shifts), -100 where no loss is taken.

Packed documents do not see each other (`isolate=True`, for the families in ISOLATING): each
row's tokens get position ids from 0, the batch carries `position_ids` and no attention mask,
and the model's attention keeps the rows apart: per segment where it is SDPA
(offload.engine.segments, which cli.loading installs), else transformers' block-causal mask
built from them (masking_utils.find_packed_sequence_indices; flash-attention's varlen path on
CUDA). Batches carry no padding mask either (batch_of).
A row's first token is not a target: the last token of the row before it would predict it.
Each row then trains as it would alone. Other families pack with one causal mask over the block
(documents attend to the ones before them), and say so once.
"""

from __future__ import annotations

import functools
import json
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np
import torch

from ..offload.core.errors import TierwiseError
from ..profiles.model import text_config
from .packing import ISOLATING, isolates  # noqa: F401 - (where the CLI and tests find them)

if TYPE_CHECKING:
    from .loading import ModelSource

log = logging.getLogger(__name__)
IGNORE = -100
#: Roles a chat row may use (the common chat templates' roles).
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function", "ipython"})



class DataError(TierwiseError):
    """The training data cannot be read: missing, empty, malformed, unknown schema."""


@dataclass(frozen=True, kw_only=True)
class Row:
    """One raw example and where it came from (for error messages)."""

    data: dict
    where: str  # "file.jsonl:12" or "dir[row 12]"


def read_rows(path: "str | Path") -> list[Row]:
    """Rows of a .jsonl file or a `datasets.save_to_disk` directory; DataError on any problem.
    All in memory: training streams them instead (iter_rows)."""
    return list(iter_rows(path))


def iter_rows(path: "str | Path") -> Iterator[Row]:
    """The rows of a .jsonl file (read line by line: one line, at most MAX_ROW_BYTES, in memory
    at a time) or of a `datasets.save_to_disk` directory; DataError on any problem, including
    a source without a single row (raised when the iteration ends)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    count = 0
    for row in _read_dataset_dir(path) if path.is_dir() else _read_jsonl(path):
        count += 1
        yield row
    if not count:
        raise DataError(f"{path}: no examples (the file is empty)")


#: The longest JSONL line read (one example): a file without newlines (/dev/zero, a 1 GiB
#: single-line dump) is refused at this size instead of filling the machine's memory.
MAX_ROW_BYTES = 64 << 20


def _read_jsonl(path: Path) -> Iterator[Row]:
    with open(path, "rb") as f:
        lineno, first = 0, True  # first: no example line read yet
        while line := f.readline(MAX_ROW_BYTES + 1):
            lineno += 1
            if len(line) > MAX_ROW_BYTES:
                raise DataError(f"{path}:{lineno}: line longer than {MAX_ROW_BYTES >> 20} MiB: "
                                "JSONL holds one example per line")
            try:  # a byte-order mark opening the file (Windows editors write one) is not data
                text = line.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                hint = (": a compressed file? give it uncompressed (JSONL text, one example per line)"
                        if lineno == 1 and line[:2] in (b"\x1f\x8b", b"BZ", b"\xfd7", b"(\xb5", b"PK") else "")
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {e.start} of the line "
                                f"is {line[e.start]:#04x}){hint}") from None
            del line
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                if first and text.lstrip().startswith("["):
                    raise DataError(f"{path}: a JSON array; the data is JSONL: one JSON object per line "
                                    "(e.g. jq -c '.[]' file.json > file.jsonl)") from None
                body = text.rstrip("\r\n")
                where = f"column {e.pos + 1}" if e.pos < len(body) else "at the end of the line"
                near = body[max(0, e.pos - 20): e.pos + 20].strip()
                raise DataError(f"{path}:{lineno}: bad JSON: {e.msg} ({where}, near {near!r})") from None
            first = False
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__} (JSONL: one "
                                "example, a JSON object, per line)")
            del text
            yield Row(data=obj, where=f"{path}:{lineno}")


def _read_dataset_dir(path: Path) -> Iterator[Row]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path} is a directory, read as a Hugging Face dataset: pip install datasets"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError/ValueError variants
        raise DataError(f"{path}: not a dataset saved with save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: dataset has no 'train' split (splits: {list(ds)})")
        ds = ds["train"]
    for i, r in enumerate(ds):  # Arrow-backed: one row in Python at a time
        yield Row(data=dict(r), where=f"{path}[row {i}]")


def schema_of(row: Row) -> str:
    """'text', 'prompt' or 'chat'; DataError naming the file and line otherwise."""
    d = row.data
    if "messages" in d:
        msgs = d["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in msgs
        ):
            raise DataError(f"{row.where}: 'messages' must be a non-empty list of "
                            "{\"role\": str, \"content\": str} objects")
        unknown = sorted({m["role"] for m in msgs} - CHAT_ROLES)
        if unknown:
            raise DataError(f"{row.where}: unknown chat role {unknown[0]!r} (known: "
                            f"{', '.join(sorted(CHAT_ROLES))})")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{row.where}: no 'assistant' turn: the loss is taken on assistant "
                            "turns only, so this conversation teaches nothing")
        return "chat"
    if "prompt" in d or "completion" in d:
        if not (isinstance(d.get("prompt"), str) and isinstance(d.get("completion"), str)):
            raise DataError(f"{row.where}: 'prompt' and 'completion' must both be strings")
        return "prompt"
    if "text" in d:
        if not isinstance(d["text"], str):
            raise DataError(f"{row.where}: 'text' must be a string")
        return "text"
    raise DataError(f"{row.where}: unknown schema with keys {sorted(d)}; expected "
                    "'text', 'prompt'+'completion', or 'messages'")


def encode_row(row: Row, tokenizer, fell_back: "list[tuple[str, str]] | None" = None
               ) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one row, eos-terminated; labels are IGNORE where no loss.
    `fell_back`: a chat row whose assistant turns could not be found adds (where the loss fell
    back to: "last" or "all", its place) to it."""
    kind = schema_of(row)
    d, eos = row.data, tokenizer.eos_token_id
    said = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(said, dict):  # (a long document is cut into blocks here: the tokenizer's length warning misleads)
        said["sequence-length-is-longer-than-the-specified-maximum"] = True
    if eos is None and kind in ("text", "prompt"):
        raise DataError(f"{row.where}: the model's tokenizer has no eos_token, which ends every "
                        f"{'text' if kind == 'text' else 'prompt/completion'} row: set eos_token in "
                        "its tokenizer_config.json")
    if kind == "text":
        ids = tokenizer(d["text"], add_special_tokens=True)["input_ids"] + [eos]
        return ids, list(ids)
    if kind == "prompt":
        p = tokenizer(d["prompt"], add_special_tokens=True)["input_ids"]
        c = tokenizer(d["completion"], add_special_tokens=False)["input_ids"] + [eos]
        return p + c, [IGNORE] * len(p) + c
    return _encode_chat(row, tokenizer, fell_back)


def _encode_chat(row: Row, tokenizer, fell_back: "list[tuple[str, str]] | None" = None
                 ) -> tuple[list[int], list[int]]:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{row.where}: chat 'messages' need a tokenizer with a chat_template")
    msgs = row.data["messages"]
    render = lambda m, gen=False: tokenizer.apply_chat_template(  # noqa: E731
        m, tokenize=False, add_generation_prompt=gen)
    try:
        full = render(msgs)
        spans, fallback = _assistant_spans(msgs, full, render)
    except DataError:
        raise
    except Exception as e:  # jinja errors: the template rejected this conversation
        raise DataError(f"{row.where}: the chat template failed: {e}") from None
    if fallback and fell_back is not None:
        fell_back.append((fallback, row.where))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    labels = [t if any(a <= s < b for a, b in spans) else IGNORE
              for t, (s, _) in zip(ids, enc["offset_mapping"])]
    return ids, labels


def _assistant_spans(msgs: list[dict], full: str, render) -> tuple[list[tuple[int, int]], str | None]:
    """Character spans of `full` that carry loss (see the module docstring), and where they fell
    back to: "last" (what follows the last user turn), "all" (every token), None."""
    spans: list[tuple[int, int]] = []
    done = 0  # where the last span ended
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start_gen, end = render(msgs[:i], True) if i else "", render(msgs[: i + 1])
        start = start_gen if full.startswith(start_gen) else (render(msgs[:i]) if i else "")
        if full.startswith(start) and full.startswith(end):
            spans.append((len(start), len(end)))
            done = len(end)
            continue
        # the template renders this turn otherwise once later turns follow (Qwen3's drops the
        # empty thinking block it gives the last one): its own text, then how the turn closes
        content = m["content"]
        if not content:  # (a tool call's turn, its call outside `content`: no text of its own to train)
            continue
        at = full.find(content, max(done, len(start)) if full.startswith(start) else done)
        close = end[end.rfind(content) + len(content):] if at >= 0 and content in end else None
        if close is None or not full.startswith(close, at + len(content)):
            break
        spans.append((at, at + len(content) + len(close)))
        done = spans[-1][1]
    else:
        if spans:
            return spans, None
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if users:
        prefix = render(msgs[: users[-1] + 1], True)
        if full.startswith(prefix):
            return [(len(prefix), len(full))], "last"
    return [(0, len(full))], "all"


def make_blocks(rows: Iterable[Row], tokenizer, *, seq_len: int, pack: bool = True, isolate: bool = False
                ) -> list[tuple[torch.Tensor, ...]]:
    """[(input_ids [T], labels [T], attention_mask [T])] with T = seq_len; packed with `isolate`,
    (input_ids, labels, attention_mask, position_ids) (see the module docstring). A block
    without a target token (all of it a masked prompt: packed chat rows, a truncated long
    prompt) is left out: it trains nothing.

    Streams: each row is tokenized and cut into blocks as it arrives, so besides the blocks
    only one row and less than one block of tokens are in memory (not the file's rows, nor
    their token lists)."""
    if seq_len < 2:
        raise DataError(f"--seq-len must be at least 2, got {seq_len}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    blocks: list = []

    def emit(ids: list[int], labels: list[int], pos: list[int] | None = None) -> None:
        if all(lab == IGNORE for lab in labels[1:]):  # no target token (after the shift): it
            return  # would weigh 0 in its step, and a step of only such blocks has no loss
        n = len(ids)
        fill = seq_len - n
        if fill and pad is None:
            raise DataError("the model's tokenizer has neither a pad_token nor an eos_token to pad "
                            "a short block with: set one in its tokenizer_config.json")
        block = (torch.tensor(ids + [pad] * fill, dtype=torch.long),
                 torch.tensor(labels + [IGNORE] * fill, dtype=torch.long),
                 torch.tensor([1] * n + [0] * fill, dtype=torch.long))
        if pos is not None:  # the padding: a segment of its own
            block += (torch.tensor(pos + list(range(fill)), dtype=torch.long),)
        blocks.append(block)

    isolate = isolate and pack
    ids_left: list[int] = []  # packing: the tokens not yet in a full block
    labels_left: list[int] = []
    pos_left: list[int] = []
    fell_back: list[tuple[str, str]] = []
    chats = 0
    for row in rows:
        chats += "messages" in row.data
        ids, labels = encode_row(row, tokenizer, fell_back)
        if not pack:
            emit(ids[:seq_len], labels[:seq_len])
            continue
        if isolate and labels:
            labels = [IGNORE] + labels[1:]  # predicted by the row before it, which it cannot see
        ids_left += ids
        labels_left += labels
        pos_left += range(len(ids))
        full = len(ids_left) - len(ids_left) % seq_len
        for i in range(0, full, seq_len):
            part = pos_left[i:i + seq_len]
            emit(ids_left[i:i + seq_len], labels_left[i:i + seq_len], _renumbered(part) if isolate else None)
        ids_left, labels_left, pos_left = ids_left[full:], labels_left[full:], pos_left[full:]
    if ids_left:  # the last, partial block (padded)
        emit(ids_left, labels_left, _renumbered(pos_left) if isolate else None)
    for kind, what in (("last", "only on what follows their last user turn (tool results there included)"),
                       ("all", "on every token, the prompts' too")):
        where = [w for k, w in fell_back if k == kind]
        if where:
            log.warning("chat loss: %d of %d conversations (e.g. %s) train %s: the chat template renders their "
                        "assistant turns otherwise once later turns follow, and their text was not found as it "
                        "renders them", len(where), chats, where[0], what)
    return blocks


def _renumbered(pos: list[int]) -> list[int]:
    """A block's positions with the row cut at its start renumbered from 0, up to where the first
    row that starts inside the block begins."""
    cut = next((j for j in range(1, len(pos)) if pos[j] == 0), len(pos))
    return [p - pos[0] for p in pos[:cut]] + pos[cut:]


def batch_of(picked: list[tuple[torch.Tensor, ...]], *, mask: bool = False) -> dict[str, Any]:
    """The model's batch of these blocks, each [B, T]: input_ids, labels and, for isolated packed
    rows, their position_ids (and no KV cache: transformers reads packed rows from position_ids
    only without a mask or a cache).

    No attention mask: every block is padded on the right, so causal attention already keeps
    each real token from the padding after it, and the padding's own outputs carry no label.
    Without a mask transformers builds no B x S x S one (is_causal). `mask`: the model reads the
    mask beyond attention (packing.keeps_mask), so it goes in. The padding's position ids go on
    from the last row's: padding is not a row of its own, and a block of one row needs no mask."""
    batch: dict[str, Any] = {"input_ids": torch.stack([p[0] for p in picked]),
                             "labels": torch.stack([p[1] for p in picked])}
    if len(picked[0]) > 3:
        batch["position_ids"] = torch.stack([_padding_goes_on(p[3], p[2]) for p in picked])
        batch["use_cache"] = False
    elif mask:
        batch["attention_mask"] = torch.stack([p[2] for p in picked])
    return batch


def _padding_goes_on(pos: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    n = int(real.sum())
    if n == len(pos):
        return pos
    return torch.cat([pos[:n], pos[n - 1] + 1 + torch.arange(len(pos) - n, dtype=pos.dtype)])


def blocks_digest(blocks: list) -> str:
    """Count and crc32 of the blocks' tokens, labels and masks: a checkpoint's data position
    means the same batches only over the same blocks (a --data edited between a kill and
    --resume tokenizes to others)."""
    crc = 0
    for block in blocks:
        for t in block:
            crc = zlib.crc32(t.numpy().tobytes(), crc)
    return f"{len(blocks)} blocks, crc32 {crc:08x}"


@dataclass(kw_only=True)
class DataPosition:
    """Where the next batch comes from: batch `index` of epoch `epoch`."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, d: dict) -> "DataPosition":
        return cls(epoch=int(d["epoch"]), index=int(d["index"]))


class Batches:
    """Deterministic, resumable batches over blocks.

    Epoch e visits the blocks in the permutation drawn from numpy's PCG64 seeded with
    (seed, e); batch i of the epoch is entries [i*B, (i+1)*B) of it (wrapping when there are
    fewer than B blocks). A trailing partial batch is dropped. Restoring `position` continues
    on exactly the batch that would have come next.
    """

    def __init__(self, blocks: list, *, batch_size: int, seed: int,
                 position: DataPosition | None = None, mask: bool = False):
        if not blocks:
            raise DataError("no training blocks: the data tokenized to nothing, or to no "
                            "target token (every label masked)")
        if batch_size < 1:
            raise DataError(f"--batch-size must be at least 1, got {batch_size}")
        self.blocks, self.batch_size, self.seed, self.mask = blocks, batch_size, seed, mask
        self.position = position or DataPosition()
        self.last_tokens = 0  # real tokens of the last batch made
        self.batches_per_epoch = max(1, len(blocks) // batch_size)

    @functools.cached_property
    def digest(self) -> str:
        """blocks_digest of the blocks (saved in each checkpoint, checked on --resume)."""
        return blocks_digest(self.blocks)

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.blocks))

    def batch_at(self, pos: DataPosition) -> dict[str, Any]:
        order, n, b = self._order(pos.epoch), len(self.blocks), self.batch_size
        picked = [self.blocks[order[(pos.index * b + j) % n]] for j in range(b)]
        self.last_tokens = sum(int(p[2].sum()) for p in picked)  # not the padding
        return batch_of(picked, mask=self.mask)

    def next(self) -> dict[str, torch.Tensor]:
        batch = self.batch_at(self.position)
        index = self.position.index + 1
        if index >= self.batches_per_epoch:
            self.position = DataPosition(epoch=self.position.epoch + 1, index=0)
        else:
            self.position = DataPosition(epoch=self.position.epoch, index=index)
        return batch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next()


def _padded(block: tuple[torch.Tensor, ...]) -> bool:
    return not bool(block[2].all())


def _rows(block: tuple[torch.Tensor, ...]) -> bool:
    """Whether the block holds several isolated rows (a position restarts inside its tokens)."""
    return len(block) > 3 and bool((block[3][1:int(block[2].sum())] == 0).any())


def has_padding(blocks: list, *, segments: bool = False, mask: bool = False) -> bool:
    """Whether some batch makes transformers build a dense B x S x S attention mask, which costs
    more device memory than a batch of the same shape without (perfmodel.activation_parts'
    `padded`), so the run is planned for it: a block of several isolated rows, unless the
    attention runs per segment (`segments`: offload.engine.segments), or a padded block whose
    mask goes in (`mask`: batch_of; isolated rows carry position ids, never a mask)."""
    return any((mask and len(b) == 3 and _padded(b)) or (not segments and _rows(b)) for b in blocks)
def check_vocab(blocks: list, src: ModelSource) -> None:
    """Every token id must be an embedding row: a tokenizer bigger than the model is an error."""
    vocab = getattr(text_config(src.config), "vocab_size", None)
    top = max((int(b[0].max()) for b in blocks), default=-1)  # no blocks: Batches says so
    if vocab and top >= vocab:
        raise DataError(f"the tokenizer produced token id {top} but the model's vocab_size is "
                        f"{vocab}: --model and its tokenizer do not match")


def padded_batch(blocks: list, *, batch_size: int, segments: bool = False, mask: bool = False
                 ) -> dict[str, torch.Tensor] | None:
    """A batch of `batch_size` blocks that holds one needing a dense mask (has_padding: the
    run's worst step), or None when no block does."""
    pad = next((b for b in blocks if has_padding([b], segments=segments, mask=mask)), None)
    if pad is None:
        return None
    return batch_of([pad] + [blocks[j % len(blocks)] for j in range(batch_size - 1)], mask=mask)


def eval_batches(blocks: list, *, batch_size: int, mask: bool = False) -> list[dict[str, torch.Tensor]]:
    """All blocks in order, in batches (the last may be smaller; `mask`: batch_of's)."""
    out = []
    for i in range(0, len(blocks), batch_size):
        out.append(batch_of(blocks[i:i + batch_size], mask=mask))
    return out


def load_blocks(path: "str | Path | None", tokenizer, *, seq_len: int, pack: bool = True,
                isolate: bool = False) -> list:
    """Blocks from `path`, or from the built-in sample when `path` is None (`isolate`: make_blocks')."""
    if path is None:
        from .builtin import sample_rows

        rows = [Row(data=r, where=f"<sample>:{i + 1}") for i, r in enumerate(sample_rows())]
    else:
        rows = iter_rows(path)  # streamed: never the whole file in memory
    return make_blocks(rows, tokenizer, seq_len=seq_len, pack=pack, isolate=isolate)
