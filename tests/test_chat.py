"""``rnnify chat``: the recurrent state carries the conversation, and each turn reads only new tokens.

The reference for a carried state is a fresh prefill of the whole rendered conversation: the replies
and the state after them must be the same. The tiny model's vocabulary is single ASCII characters
(no merges), so a reply re-tokenizes to the ids the model generated and rule 1 of ``rnnify.chat``
always applies.
"""

from __future__ import annotations

import builtins
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rnnify
from rnnify import cli
from rnnify.chat import Chat
from rnnify.cli import main
from rnnify.data import load_tokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NEW_TOKENS = 6
ROOT = Path(__file__).resolve().parents[1]


def make_chat_model(directory: Path, learned_positions: int | None = None) -> Path:
    """A random 2-layer llama with a one-character-per-token tokenizer and a ChatML template; a GPT-2
    with a table of ``learned_positions`` where given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    chars = [spelling[byte] for byte in (10, *range(32, 127))]
    vocab = {token: i for i, token in enumerate(chars + SPECIAL)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=vocab["<|im_end|>"],
        bos_token_id=vocab["<|im_start|>"],
    )
    if learned_positions is None:
        LlamaForCausalLM(config).save_pretrained(directory)
    else:
        table = GPT2Config(
            vocab_size=len(vocab),
            n_positions=learned_positions,
            n_embd=32,
            n_layer=2,
            n_head=4,
            eos_token_id=config.eos_token_id,
            bos_token_id=config.bos_token_id,
        )
        GPT2LMHeadModel(table).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def chat_dirs(tmp_path_factory):
    """``chat_dirs(target)`` -> a converted chat model directory (converted once per target)."""
    source = make_chat_model(tmp_path_factory.mktemp("chat-hf"))
    saved: dict[str, Path] = {}
    options = {"exact": {}, "linear": {"feature_map": "elu"}}

    def get(target: str) -> Path:
        if target not in saved:
            saved[target] = rnnify.convert(source, to=target, **options[target]).save(
                tmp_path_factory.mktemp(f"chat-{target}") / "model"
            )
        return saved[target]

    return get


def rendered_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("target", ["exact", "linear"])
def test_carried_state_equals_a_fresh_prefill_of_the_conversation(chat_dirs, target):
    model, reference = rnnify.load(chat_dirs(target)), rnnify.load(chat_dirs(target))
    tokenizer = load_tokenizer(chat_dirs(target))
    prefilled: list[int] = []
    prefill = model.prefill
    model.prefill = lambda ids, state=None: prefilled.append(ids.shape[1]) or prefill(ids, state)
    chat = Chat(model, tokenizer, system="Be brief.", max_new_tokens=NEW_TOKENS)

    messages = [{"role": "system", "content": "Be brief."}]
    consumed = 0
    for question in ("hello there", "and then?"):
        messages.append({"role": "user", "content": question})
        conversation = rendered_ids(tokenizer, messages)
        turn = chat.send(question)
        # Only what the state has not read yet: the rendered conversation minus all earlier tokens.
        assert prefilled[-1] == turn.read == len(conversation) - consumed
        assert turn.rule == "tokens"
        fresh = reference.generate(torch.tensor([conversation]), NEW_TOKENS, eos_token_id=tokenizer.eos_token_id)
        assert turn.reply_ids == fresh[0, len(conversation) :].tolist()
        consumed = len(conversation) + len(turn.reply_ids)
        assert turn.tokens == consumed
        reply = turn.reply_ids[:-1] if turn.reply_ids[-1] == tokenizer.eos_token_id else turn.reply_ids
        messages.append({"role": "assistant", "content": tokenizer.decode(reply)})

    everything = torch.tensor([conversation + turn.reply_ids])
    _, state = reference.prefill(everything)
    for carried, expected in zip(chat.state.tensors, state.tensors):
        torch.testing.assert_close(carried, expected, rtol=1e-4, atol=1e-5)
    assert len(prefilled) == 2  # each turn read its new tokens in one call, the reply one step per token


def test_reset_starts_a_new_conversation(chat_dirs):
    model, tokenizer = rnnify.load(chat_dirs("linear")), load_tokenizer(chat_dirs("linear"))
    chat = Chat(model, tokenizer, max_new_tokens=NEW_TOKENS)
    first = chat.send("hello")
    chat.send("more")
    chat.reset()
    again = chat.send("hello")
    assert (again.read, again.reply_ids, again.tokens) == (first.read, first.reply_ids, first.tokens)
    assert chat.messages[0] == {"role": "user", "content": "hello"}


def test_chat_without_a_template_is_refused(chat_dirs):
    tokenizer = load_tokenizer(chat_dirs("exact"))
    tokenizer.chat_template = None
    with pytest.raises(rnnify.RnnifyError, match="no chat template"):
        Chat(rnnify.load(chat_dirs("exact")), tokenizer)


def chat_lines(capsys, monkeypatch, directory: Path, text: str, *flags: str) -> tuple[list[str], list[int]]:
    """Run ``rnnify chat`` in-process on stdin ``text``; (state-size lines, tokens read per turn)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code = main(["chat", str(directory), "--verbose", "--max-new-tokens", str(NEW_TOKENS), *flags])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    sizes = re.findall(r"^\[(\d+) tokens, state (.+)\]$", out, flags=re.M)
    reads = [int(n) for n in re.findall(r"^\(read (\d+) new tokens", out, flags=re.M)]
    return sizes, reads


@pytest.mark.parametrize("target, constant", [("linear", True), ("exact", False)])
def test_state_size_line_per_reply(capsys, monkeypatch, chat_dirs, target, constant):
    sizes, reads = chat_lines(capsys, monkeypatch, chat_dirs(target), "hi\nwhat now\n\n/reset\nhi\n", "--system", "x")
    assert len(sizes) == len(reads) == 3
    tokens = [int(n) for n, _ in sizes]
    assert tokens[0] < tokens[1] and tokens[2] == tokens[0] and reads[2] == reads[0]
    states = [state for _, state in sizes]
    if constant:
        assert states[0] == states[1] == states[2]
    else:
        assert states[0] != states[1] and states[2] == states[0]


def test_a_mistyped_command_is_not_sent(capsys, monkeypatch, chat_dirs):
    """'/rest' is a command mistyped, not a message: said so, and the conversation is as without it;
    a message that merely starts with '/' is sent."""
    sizes, reads = chat_lines(capsys, monkeypatch, chat_dirs("linear"), "hi\n/rest\nwhat now\n")
    want_sizes, want_reads = chat_lines(capsys, monkeypatch, chat_dirs("linear"), "hi\nwhat now\n")
    assert (sizes, reads) == (want_sizes, want_reads)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n/rest\n/usr/bin is where?\n"))
    assert main(["chat", str(chat_dirs("linear")), "--verbose", "--max-new-tokens", str(NEW_TOKENS)]) == 0
    out = capsys.readouterr().out
    assert "unknown command /rest: /reset is the one command; nothing was sent" in out
    assert len(re.findall(r"^\(read \d+ new tokens", out, flags=re.M)) == 2


def test_chat_ends_cleanly_on_ctrl_c(capsys, monkeypatch, chat_dirs):
    def interrupted(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr(builtins, "input", interrupted)
    assert main(["chat", str(chat_dirs("linear"))]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_chat_command_through_stdin(chat_dirs):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "rnnify", "chat", str(chat_dirs("exact")), "--verbose", "--max-new-tokens", "4"],
        input="hello there\nand you?\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    reads = [int(n) for n in re.findall(r"^\(read (\d+) new tokens", result.stdout, flags=re.M)]
    how = re.findall(r"^\(read \d+ new tokens; (.+)\)$", result.stdout, flags=re.M)  # a rule of rnnify.chat, in words
    assert len(how) == 2 and set(how) <= set(cli.chat._RULES.values()), result.stdout
    sizes = re.findall(r"^\[(\d+) tokens, state .+\]$", result.stdout, flags=re.M)
    assert len(reads) == len(sizes) == 2
    # The second turn reads the reply's close, the new message and the header: not the history again.
    assert reads[1] < int(sizes[0])


LEARNED = 40  # positions of the GPT-2 below


@pytest.fixture(scope="module")
def learned_chat(tmp_path_factory):
    """The directory of a converted chat model with learned positions (a last position)."""
    source = make_chat_model(tmp_path_factory.mktemp("chat-gpt2"), learned_positions=LEARNED)
    return rnnify.convert(source, to="exact").save(tmp_path_factory.mktemp("chat-gpt2-exact") / "model")


def test_a_conversation_holds_up_to_the_last_position_and_refuses_past_it(learned_chat):
    directory = learned_chat
    model, reference = rnnify.load(directory), rnnify.load(directory)
    tokenizer = load_tokenizer(directory)
    chat = Chat(model, tokenizer, max_new_tokens=100, eos_token_id=[])  # no end token: the reply runs to the limit
    turn = chat.send("hi")
    assert turn.tokens == LEARNED and chat.room() == 0 and len(turn.reply_ids) == LEARNED - turn.read
    _, state = reference.prefill(torch.tensor([chat.consumed]))  # the state read every token, the last reply's too
    for carried, expected in zip(chat.state.tensors, state.tensors):
        torch.testing.assert_close(carried, expected, rtol=1e-4, atol=1e-5)
    messages, consumed = list(chat.messages), list(chat.consumed)
    with pytest.raises(rnnify.RnnifyError, match=f"has 0 left of the model's {LEARNED} learned positions.*/reset"):
        chat.send("more")
    assert chat.messages == messages and chat.consumed == consumed  # refused before it was read
    chat.reset()
    assert chat.send("hi").reply_ids == turn.reply_ids


def test_a_turn_without_room_for_a_reply_is_refused_before_it_is_read(learned_chat):
    directory = learned_chat
    chat = Chat(rnnify.load(directory), load_tokenizer(directory), max_new_tokens=4)
    with pytest.raises(
        rnnify.RnnifyError, match=rf"and one for the reply\), and the conversation has {LEARNED} left of"
    ):
        chat.send("x" * LEARNED)
    assert chat.messages == [] and chat.consumed == [] and chat.state is None


def test_chat_command_at_the_last_position(capsys, monkeypatch, learned_chat):
    directory = learned_chat
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nmore\n"))
    code = main(["chat", str(directory), "--max-new-tokens", "100"])
    out, err = capsys.readouterr()
    # the first reply runs to the last position (this random model never ends a reply early), which the
    # state-size line says; not at a terminal, the turn that does not fit then ends the run in one line
    words = " ".join(out.split())  # the console wraps its lines
    assert re.search(rf"\[{LEARNED} tokens, state [^\]]+\] \(no room for another turn: /reset", words), out
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1 and "/reset" in err, err


def test_a_turn_fits_with_one_position_for_its_reply(learned_chat):
    directory = learned_chat
    tokenizer = load_tokenizer(directory)
    around = len(rendered_ids(tokenizer, [{"role": "user", "content": ""}]))  # the template's tokens
    fits = "x" * (LEARNED - 1 - around)  # a turn of LEARNED - 1 tokens: one position left, for the reply
    chat = Chat(rnnify.load(directory), tokenizer, max_new_tokens=100, eos_token_id=[])
    with pytest.raises(rnnify.RnnifyError, match=f"needs {LEARNED + 1} positions"):
        chat.send(fits + "x")
    turn = chat.send(fits)
    assert turn.read == LEARNED - 1 and len(turn.reply_ids) == 1 and chat.room() == 0


def test_chat_at_a_terminal_goes_on_after_a_turn_that_does_not_fit(capsys, monkeypatch, learned_chat):
    directory = learned_chat
    stdin = io.StringIO("hi\nmore\n/reset\nhi\n")
    stdin.isatty = lambda: True
    monkeypatch.setattr(sys, "stdin", stdin)
    code = main(["chat", str(directory), "--max-new-tokens", "100"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    words = " ".join(out.split())  # the console wraps its lines
    assert "error: this turn needs" in words and "start a new conversation (/reset)" in words, out
    assert len(re.findall(rf"^\[{LEARNED} tokens, state ", out, flags=re.M)) == 2, out  # a turn again after /reset
