"""rnnify.data.token_batches: packing, determinism, rank slices, inputs, limits and errors."""

from __future__ import annotations

import json

import pytest
import torch

from rnnify.data import token_batches
from rnnify.errors import RnnifyError

DOCS = [
    "def main():\n    return 1\n",
    "import os\nprint(os.getcwd())\n",
    "x = [i * i for i in range(10)]\n",
    "class A:\n    pass\n",
    "while True:\n    break\n",
    "# a comment\n",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


def _stream(tokenizer, docs):
    return [t for d in docs for t in [*tokenizer(d, add_special_tokens=False).input_ids, tokenizer.eos_token_id]]


def _real(batches):
    """The real tokens of the batches, in order, and the padding check: right padding only."""
    out = []
    for batch in batches:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == mask.shape
        assert torch.equal(mask, mask.cummin(dim=1).values), "padding must be on the right"
        assert not ids[~mask].any(), "padding ids are 0"
        out += ids[mask].tolist()
    return out


def _jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _folder(root, docs):
    for i, d in enumerate(docs):
        (root / f"sub{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"sub{i % 2}" / f"f{i}.py").write_text(d)
    return root


def test_jsonl_packs_documents_with_eos(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "d.jsonl", DOCS)
    batches = list(token_batches(path, tokenizer, seq_len=7, batch_size=3))
    stream = _stream(tokenizer, DOCS)
    assert _real(batches) == stream
    rows = torch.cat([b["input_ids"] for b in batches])
    lengths = torch.cat([b["attention_mask"] for b in batches]).sum(1).tolist()
    assert all(n == 7 for n in lengths[: len(stream) // 7]) and sum(lengths) == len(stream)
    assert rows.shape[1] == 7 and all(b["input_ids"].shape[0] == 3 for b in batches)


def test_folder_recursive_deterministic_skips_binary_and_hidden(tmp_path, tokenizer):
    root = _folder(tmp_path / "corpus", DOCS)
    (root / "blob.bin").write_bytes(b"\x00\x01\x02" * 10)
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: main\n")
    _jsonl(root / "more.jsonl", ["print(1)\n", "print(2)\n"])
    run = lambda seed: _real(token_batches(root, tokenizer, seq_len=16, batch_size=2, seed=seed))  # noqa: E731
    first, again, other = run(0), run(0), run(1)
    assert first == again and first != other
    expected = _stream(tokenizer, [*DOCS, "print(1)\n", "print(2)\n"])
    assert sorted(first) == sorted(other) == sorted(expected)


def test_tokenizer_from_directory(tmp_path, tokenizer, tiny_model_dir):
    path = tmp_path / "a.txt"
    path.write_text(DOCS[0])
    assert _real(token_batches(path, tiny_model_dir("llama"), seq_len=8, batch_size=1)) == _stream(tokenizer, DOCS[:1])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_see_the_single_process_rows(tmp_path, tokenizer, world_size):
    path = _jsonl(tmp_path / "d.jsonl", DOCS * 3)
    single = list(token_batches(path, tokenizer, seq_len=5, batch_size=8))
    ranks = [
        list(token_batches(path, tokenizer, seq_len=5, batch_size=8, rank=r, world_size=world_size))
        for r in range(world_size)
    ]
    assert all(len(r) == len(ranks[0]) for r in ranks) and len(ranks[0]) >= len(single) - 1
    for step, want in enumerate(single[: len(ranks[0])]):
        for key in ("input_ids", "attention_mask"):
            assert torch.equal(torch.cat([r[step][key] for r in ranks]), want[key])
        assert all(r[step]["attention_mask"].any() for r in ranks)


def test_last_batch_dropped_when_a_rank_would_get_only_padding():
    ids = torch.arange(1, 11)[:, None].repeat(1, 4)  # 10 rows of 4 tokens
    single = list(token_batches(ids, seq_len=4, batch_size=8))
    assert [b["attention_mask"].any(1).sum().item() for b in single] == [8, 2]
    two = [list(token_batches(ids, seq_len=4, batch_size=8, rank=r, world_size=2)) for r in range(2)]
    assert [len(r) for r in two] == [1, 1]  # rank 1 would get 4 padding rows: the last batch is dropped
    five = [list(token_batches(ids, seq_len=4, batch_size=10, rank=r, world_size=5)) for r in range(5)]
    assert [len(r) for r in five] == [1] * 5  # 10 rows, 2 per rank: nothing dropped


def test_tensor_rows_split_in_order():
    ids = torch.arange(30).view(3, 10)
    batches = list(token_batches(ids, seq_len=4, batch_size=2))
    rows = torch.cat([b["input_ids"] for b in batches])
    lengths = torch.cat([b["attention_mask"] for b in batches]).sum(1).tolist()
    assert lengths == [4, 4, 2] * 3 + [0]  # each row split into 4 + 4 + 2, the last batch padded
    assert rows[2, :2].tolist() == [8, 9] and rows[3].tolist() == [10, 11, 12, 13]
    assert _real(batches) == list(range(30))


def test_iterable_of_dicts_with_masks():
    left = {"input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}
    right = {"input_ids": torch.tensor([[3, 4, 0]]), "attention_mask": torch.tensor([[True, True, False]])}
    source = iter([left, torch.tensor([[1, 2]]), right])
    assert _real(token_batches(source, seq_len=3, batch_size=2)) == [5, 6, 7, 8, 9, 1, 2, 3, 4]


def test_max_tokens_counts_real_tokens(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "d.jsonl", DOCS)
    stream = _stream(tokenizer, DOCS)
    got = _real(token_batches(path, tokenizer, seq_len=8, batch_size=2, max_tokens=21))
    assert got == stream[:21]
    ranks = [
        list(token_batches(path, tokenizer, seq_len=8, batch_size=2, world_size=2, rank=r, max_tokens=29))
        for r in range(2)
    ]  # rows of 8, 8 | 8, 5: every rank has real tokens in both batches
    assert sum(int(b["attention_mask"].sum()) for r in ranks for b in r) == 29


def test_skip_batches_resumes(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "d.jsonl", DOCS)
    kwargs = dict(seq_len=6, batch_size=2, max_tokens=50)
    full = list(token_batches(path, tokenizer, **kwargs))
    resumed = list(token_batches(path, tokenizer, skip_batches=2, **kwargs))
    assert len(resumed) == len(full) - 2
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(full[2:], resumed))
    assert list(token_batches(path, tokenizer, skip_batches=100, **kwargs)) == []


def _file(tmp_path, name, content):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        (lambda p: p / "missing.txt", {}, "does not exist"),
        (lambda p: _file(p, "a.jsonl", '{"text": "ok"}\n{"content": "x"}\n'), {}, 'a.jsonl:2 has no string "text"'),
        (lambda p: _file(p, "a.jsonl", '{"text": "ok"}\n\nnot json\n'), {}, "a.jsonl:3 is not JSON"),
        (lambda p: _file(p, "empty.txt", ""), {}, "holds no tokens"),
        (lambda p: _file(p, "latin.txt", b"caf\xe9"), {}, "not UTF-8"),
        (lambda p: _file(p, "bin/x", b"\0").parent, {}, "no text files"),
        (lambda p: torch.rand(2, 3), {}, "integer tensor"),
        (lambda p: torch.arange(5), {}, r"\[N, T\]"),
        (lambda p: torch.tensor([[1, -2]]), {}, "negative"),
        (lambda p: {"ids": torch.ones(1, 2)}, {}, "without input_ids"),
        (
            lambda p: {"input_ids": torch.ones(1, 2, dtype=torch.long), "attention_mask": torch.ones(1, 3)},
            {},
            "shaped like input_ids",
        ),
        (lambda p: 42, {}, "got int"),
        (lambda p: torch.ones(1, 2, dtype=torch.long), {"batch_size": 6, "world_size": 4}, "not divisible"),
        (lambda p: torch.ones(1, 2, dtype=torch.long), {"rank": 2, "world_size": 2}, "rank must be"),
        (lambda p: torch.ones(1, 2, dtype=torch.long), {"seq_len": 0}, r"seq_len \(--seq-len\) must be"),
        (lambda p: torch.ones(1, 2, dtype=torch.long), {"max_tokens": 0}, r"max_tokens \(--max-tokens\) must be"),
        (lambda p: torch.zeros(1, 0, dtype=torch.long), {}, "holds no tokens"),
    ],
)
def test_errors(tmp_path, tokenizer, make, kwargs, match):
    options = {"seq_len": 4, "batch_size": 2, **kwargs}
    with pytest.raises(RnnifyError, match=match):
        list(token_batches(make(tmp_path), tokenizer, **options))


def test_text_needs_a_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(RnnifyError, match="needs a tokenizer"):
        token_batches(tmp_path / "a.txt", seq_len=4, batch_size=1)  # raised at the call, not on iteration
    with pytest.raises(RnnifyError, match="tokenizer directory"):
        token_batches(tmp_path / "a.txt", tmp_path / "nope", seq_len=4, batch_size=1)


def test_large_file_tokenized_in_pieces_is_one_document(tmp_path, tokenizer, monkeypatch):
    import rnnify.data

    monkeypatch.setattr(rnnify.data, "_PIECE_CHARS", 20)
    text = "".join(DOCS)
    path = _file(tmp_path, "big.py", text)
    got = _real(token_batches(path, tokenizer, seq_len=16, batch_size=2))
    assert got.count(tokenizer.eos_token_id) == 1 and got[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(got[:-1]) == text


def test_tokenizer_directory_without_a_vocabulary_is_refused(tmp_path, tiny_model_dir):
    import shutil

    path = _file(tmp_path, "a.txt", "hello")
    directory = tmp_path / "config-only"
    directory.mkdir()
    shutil.copy(tiny_model_dir("gpt2") / "config.json", directory)
    with pytest.raises(RnnifyError, match="holds no tokenizer files.*--tokenizer DIR"):
        token_batches(path, directory, seq_len=4, batch_size=1)
    (directory / "tokenizer_config.json").write_text("{}")  # transformers makes a 1-token tokenizer of this
    with pytest.raises(RnnifyError, match="1 token.*no vocabulary.*--tokenizer DIR"):
        token_batches(path, directory, seq_len=4, batch_size=1)


class BosTokenizer:
    """Characters as ids; like Llama's tokenizers it adds BOS (1) itself unless told not to. EOS 2."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text, add_special_tokens=True, verbose=True):
        encode = lambda t: [1] * add_special_tokens + [ord(c) for c in t]  # noqa: E731
        return {"input_ids": [encode(t) for t in text] if isinstance(text, list) else encode(text)}


def test_documents_start_with_bos_when_the_tokenizer_adds_it(tmp_path, monkeypatch):
    import rnnify.data

    expected = [t for d in DOCS for t in [1, *map(ord, d), 2]]
    assert _real(token_batches(_jsonl(tmp_path / "d.jsonl", DOCS), BosTokenizer(), seq_len=7, batch_size=3)) == expected
    monkeypatch.setattr(rnnify.data, "_PIECE_CHARS", 20)  # one document in several pieces: one BOS
    got = _real(token_batches(_file(tmp_path, "big.py", "".join(DOCS)), BosTokenizer(), seq_len=16, batch_size=2))
    assert got == [1, *map(ord, "".join(DOCS)), 2]
