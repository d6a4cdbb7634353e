"""A converted model as an lm-evaluation-harness model, registered as ``rnnify``.

    rnnify-lm-eval --model rnnify --model_args path=DIR --tasks hellaswag

lm-eval 0.4 finds models only in its own registry (no plugin entry points), so the model is
registered when this module is imported: ``rnnify-lm-eval`` (same arguments as ``lm_eval``) imports
it and then runs lm-eval's own command line; from Python, import this module before
``lm_eval.simple_evaluate(model="rnnify", ...)``.

``loglikelihood`` reads each request (context + continuation, truncated on the left as
lm-eval's ``hf`` model does) in one prefill, rows of a batch left-padded; ``loglikelihood_rolling``
scores lm-eval's rolling windows the same way; ``generate_until`` prefills the context and then
decodes through the recurrent step until a stop string, end of text or ``max_gen_toks``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from tqdm import tqdm

from rnnify.errors import RnnifyError
from rnnify.runtime.sampling import check_sampling, next_token

__all__ = ["RnnifyLM", "main"]

DEFAULT_MAX_LENGTH = 2048


def _device(device: str | None) -> str:
    """lm-eval's command line asks for ``cuda:0`` unless told otherwise; like its ``hf`` model,
    run on the CPU (with a warning) where there is no GPU."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        warnings.warn(f"device {device}: no CUDA here, running on the CPU", stacklevel=3)
        return "cpu"
    return device


@register_model("rnnify")
class RnnifyLM(TemplateLM):
    """lm-eval's interface over ``rnnify.load(path)`` and the tokenizer saved beside it.

    ``max_length`` (tokens per scored window) defaults to the model's position limit, else 2048;
    ``batch_size`` rows share one prefill.
    """

    def __init__(
        self,
        path: str | None = None,
        pretrained: str | None = None,
        batch_size: int | str = 1,
        device: str | None = None,
        kernels: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool = False,
        **kwargs: Any,
    ):
        super().__init__()
        import rnnify
        from rnnify.data import load_tokenizer

        directory = path or pretrained
        if directory is None:
            raise RnnifyError("--model_args: give path=DIR, a directory written by `rnnify convert`")
        self.model = rnnify.load(directory, device=_device(device), kernels=kernels)
        self.tokenizer = load_tokenizer(Path(directory), fix="copy the source model's tokenizer files into it")
        self.batch_size = 1 if batch_size in ("auto", None) else int(str(batch_size).split(":")[0])
        limit = self.model.manifest.positions.get("limit")
        self._max_length = int(max_length) if max_length is not None else int(limit or DEFAULT_MAX_LENGTH)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = bool(add_bos_token)

    # -- what lm-eval asks of a model --------------------------------------------------------

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if self.add_bos_token and bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=special)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # -- scoring ----------------------------------------------------------------------------

    def _score(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(context, continuation)`` token lists -> (log-probability of the continuation, greedy?),
        all rows in one prefill. The window is the last ``max_length + 1`` tokens, less the last."""
        device = self.model.device
        inputs = [(context + continuation)[-(self.max_length + 1) :][:-1] for context, continuation in rows]
        width = max(len(ids) for ids in inputs)
        ids = torch.zeros(len(inputs), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(inputs), width, dtype=torch.bool, device=device)
        for row, tokens in enumerate(inputs):
            ids[row, width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens) :] = True
        logits, _ = self.model.prefill(ids, attention_mask=None if bool(mask.all()) else mask)
        results = []
        for row, (_, continuation) in enumerate(rows):
            scores = F.log_softmax(logits[row, width - len(continuation) :].double(), dim=-1)
            target = torch.tensor(continuation, dtype=torch.long, device=device)
            greedy = bool((scores.argmax(-1) == target).all())
            results.append((float(scores.gather(-1, target[:, None]).sum()), greedy))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        # Longest first, so a batch pads little and an out-of-memory error comes at once.
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        results: list[Any] = [None] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="rnnify loglikelihood")
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for index, result in zip(chunk, self._score([(requests[i][1], requests[i][2]) for i in chunk])):
                results[index] = result
                if requests[index][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[index][0], result)
            progress.update(len(chunk))
        progress.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        results = []
        for request in tqdm(requests, disable=disable_tqdm, desc="rnnify loglikelihood_rolling"):
            (string,) = request.args
            windows = map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            )
            scored = self._loglikelihood_tokens([(None, *window) for window in windows], disable_tqdm=True)
            total = sum(logprob for logprob, _ in scored)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            results.append(total)
        return results

    # -- generation -------------------------------------------------------------------------

    def _generate(self, context: list[int], until: list[str], max_gen_toks: int, options: dict[str, Any]) -> str:
        do_sample = bool(options.get("do_sample")) and float(options.get("temperature", 1.0)) > 0
        temperature = float(options.get("temperature", 1.0)) if do_sample else 1.0
        top_k, top_p = options.get("top_k"), options.get("top_p")
        check_sampling(temperature, top_k, top_p)
        generator = None
        if options.get("seed") is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(int(options["seed"]))
        ids = torch.tensor([context], dtype=torch.long, device=self.model.device)
        logits, state = self.model.prefill(ids)
        tokens: list[int] = []
        text = ""
        for _ in range(max_gen_toks):
            token = next_token(logits[:, -1], do_sample, temperature, top_k, top_p, generator)
            if int(token) == self.eot_token_id:
                break
            tokens.append(int(token))
            text = self.tok_decode(tokens)
            if any(stop in text for stop in until):
                break
            logits, state = self.model.step(token[:, None], state)
        for stop in until:
            text = text.split(stop)[0]
        return text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results = []
        for request in tqdm(requests, disable=disable_tqdm, desc="rnnify generate_until"):
            context, gen_kwargs = request.args
            options = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(options.pop("until", None), eos=eos)
            max_gen_toks = options.pop("max_gen_toks")
            context_ids = self.tok_encode(context)[-max(1, self.max_length - max_gen_toks) :] or [self.prefix_token_id]
            text = self._generate(context_ids, until, max_gen_toks, options)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            results.append(text)
        return results


def main() -> None:
    """``rnnify-lm-eval``: lm-eval's command line, with the ``rnnify`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
