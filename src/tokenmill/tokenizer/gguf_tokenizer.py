"""A `tokenizers.Tokenizer` assembled from GGUF metadata, wrapped with BOS/EOS handling.

- `gpt2` (byte-level BPE): vocabulary + merges, the pre-tokenizer that `tokenizer.ggml.pre` names, byte-level
  decoding.
- `llama` (SentencePiece-style BPE with scores): the merges SentencePiece would apply are derived from the scores
  (a merge ranks by the score of the token it makes), with byte fallback, "▁" for spaces and an optional "▁"
  prefix (`tokenizer.ggml.add_space_prefix`).

Control and user-defined tokens are added tokens, matched in the raw text before anything else, so special
tokens written in a prompt are parsed as special (as HF's tokenizers and llama.cpp with parse_special do).
"""

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tokenmill.errors import InvalidParameterError, ModelFileError, UnsupportedModelError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.tokenizer.pretokenizers import PRE_TOKENIZERS

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
END_OF_TURN = frozenset({"<end_of_turn>"})  # control tokens that end generation besides EOS (Gemma's turns)
SPIECE_SPACE = "\u2581"  # "▁"
LONG_DECODE = 4096  # ids; fewer (the detokenizer's few at a time) through the plain call, which costs less


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _gpt2_byte_decoder()


class Tokenizer:
    """Text <-> token ids for one model. `encode` parses special tokens written in the text as special."""

    def __init__(
        self,
        backend: HFTokenizer,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        add_eos: bool = False,
        eos_token_ids: frozenset[int] = frozenset(),
        kind: str = "gpt2",
        max_token_chars: int | None = None,
    ):
        self.backend = backend
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self.kind = kind
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        # every token that ends generation (the EOS and, e.g., an end-of-turn token)
        self.stop_token_ids = eos_token_ids | ({eos_token_id} if eos_token_id is not None else set())
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._added_ids = set(backend.get_added_tokens_decoder())  # special and user-defined tokens
        # no token covers more characters of the text than this (None: no such bound is known), so a text of
        # n characters has at least n / max_token_chars tokens: a length check that needs no tokenizing
        self.max_token_chars = max_token_chars

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "Tokenizer":
        return build_tokenizer(gguf)

    def min_tokens(self, text: str) -> int:
        """A lower bound of the number of tokens `text` becomes, without tokenizing it."""
        return -(-len(text) // self.max_token_chars) if self.max_token_chars else 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. With `add_special_tokens`, BOS (and EOS) are added when the model's metadata says so."""
        try:
            # the batch call lets other threads run while it works (encode() holds the GIL throughout: a long text
            # would stop the server's event loop); the fast variant skips the character offsets we never read
            ids = self._encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError as exc:  # a lone surrogate ("\ud800"): not text the tokenizer can take
            if isinstance(text, str):
                raise InvalidParameterError("the text is not valid Unicode (a lone surrogate?)", "prompt") from exc
            raise
        if add_special_tokens:
            if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
                ids = [self.bos_token_id, *ids]
            if self.add_eos and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if len(ids) > LONG_DECODE:  # the batch call lets other threads run while it works (decode() does not)
            return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (a byte-level piece may be part of a UTF-8 character)."""
        piece = self.backend.id_to_token(token_id) or ""
        if token_id in self._added_ids:
            return piece.encode()
        if self.kind == "gpt2":
            return bytes(_BYTE_DECODER.get(c, 0) for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace(SPIECE_SPACE, " ").encode()

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str:
        return (self.id_to_token(self.bos_token_id) or "") if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return (self.id_to_token(self.eos_token_id) or "") if self.eos_token_id is not None else ""


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    kind = gguf.require("tokenizer.ggml.model")
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    types: list[int] = gguf.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFileError(f"{gguf.path}: {len(tokens)} tokens but {len(types)} token types")
    # a token covers at most as many characters of the text as its piece has (a byte-level piece: one per byte;
    # a SentencePiece piece: "▁" for a space). Without all 256 byte tokens, SentencePiece fuses what it cannot
    # spell into one unknown token of any length: no bound then.
    max_token_chars: int | None = max(map(len, tokens), default=1)
    if kind == "gpt2":
        backend = _byte_level_bpe(gguf, tokens)
        default_add_bos = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(gguf, tokens, types)
        default_add_bos = True
        if sum(t == TOKEN_BYTE for t in types) < 256:
            max_token_chars = None
    else:
        raise UnsupportedModelError(
            f"{gguf.path}: tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')"
        )
    special = [
        AddedToken(tok, special=(t != TOKEN_USER_DEFINED), normalized=False)
        for tok, t in zip(tokens, types, strict=True)
        if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)
    ]
    backend.add_special_tokens([t for t in special if t.special])
    backend.add_tokens([t for t in special if not t.special])
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    eot = gguf.get("tokenizer.ggml.eot_token_id")
    eog = {int(eos)} if eos is not None else set()
    if eot is not None:
        eog.add(int(eot))
    # a chat model's end of turn ends generation, as in llama.cpp (Gemma's files name none: EOS is <eos>)
    eog.update(
        i for i, (tok, t) in enumerate(zip(tokens, types, strict=True)) if tok in END_OF_TURN and t == TOKEN_CONTROL
    )
    return Tokenizer(
        backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        add_bos=bool(gguf.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        add_eos=bool(gguf.get("tokenizer.ggml.add_eos_token", False)),
        eos_token_ids=frozenset(eog),
        kind=kind,
        max_token_chars=max_token_chars,
    )


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str]) -> HFTokenizer:
    merges_raw: list[str] = gguf.require("tokenizer.ggml.merges")
    pre_name = gguf.get("tokenizer.ggml.pre", "default")
    if pre_name not in PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"{gguf.path}: pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    regexes, ignore_merges = PRE_TOKENIZERS[pre_name]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ModelFileError(f"{gguf.path}: malformed BPE merge {m!r}")
        merges.append((left, right))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(gguf: GGUFFile, tokens: list[str], types: list[int]) -> HFTokenizer:
    scores: list[float] = gguf.require("tokenizer.ggml.scores")
    if len(scores) != len(tokens):
        raise ModelFileError(f"{gguf.path}: {len(tokens)} tokens but {len(scores)} scores")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # SentencePiece BPE repeatedly merges the adjacent pair whose merged piece has the highest score; the
    # equivalent ranked merge list has every (left, right) split of every piece, ordered by the piece's score.
    candidates = []
    for piece, piece_id in vocab.items():
        if types[piece_id] == TOKEN_BYTE or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[piece_id], vocab[left], vocab[right], left, right))
    candidates.sort()
    merges = [(left, right) for _, _, _, left, right in candidates]
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None if unk_id is None else tokens[int(unk_id)],
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    add_prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPIECE_SPACE)] if add_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPIECE_SPACE)])
    decode_steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend
